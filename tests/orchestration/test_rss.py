"""``ckpt_core.rss``: each figure keeps its one meaning. Resident now goes up and down with
what the process holds; the peak since a reset forgets what came before the reset; the
lifetime peak forgets nothing, resets included (the kernel's own mark, and ``ru_maxrss``,
do forget it). Measured on this process's real memory (Linux)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckpt_core.rss import lifetime_peak_rss_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")

BLOCK = 128 << 20  # well above glibc's mmap threshold: freeing it hands its pages back at once


def _resident_block() -> bytearray:
    """``BLOCK`` bytes, every page written (so resident)."""
    return bytearray(b"\x01") * BLOCK


def _rss() -> int:
    now = rss_bytes()
    assert now is not None
    return now


def test_each_figure_keeps_its_own_meaning() -> None:
    # The kernel counts pages in batches and samples its mark as memory is unmapped, so a
    # figure is checked against the block it must (or must not) include, not to the byte.
    assert reset_peak_rss(), "this kernel refuses /proc/self/clear_refs"
    before = _rss()
    block = _resident_block()
    assert _rss() - before >= BLOCK * 0.9, "rss_bytes is what is resident now"
    del block
    assert _rss() - before < BLOCK * 0.1, "rss_bytes goes down when memory is handed back"

    first_window = peak_rss_bytes()
    assert first_window is not None and first_window - before >= BLOCK * 0.9, "the peak since the reset saw the block"
    assert lifetime_peak_rss_bytes() - before >= BLOCK * 0.9

    assert reset_peak_rss()
    second_window = peak_rss_bytes()
    assert second_window is not None and second_window - before < BLOCK * 0.1, (
        "a reset starts a new window: the block freed before it is not in it"
    )
    assert lifetime_peak_rss_bytes() - before >= BLOCK * 0.9, "the lifetime peak keeps what a reset cleared"

    block = _resident_block()
    after = peak_rss_bytes()
    assert after is not None and after - second_window >= BLOCK * 0.9, "the new window sees what came after it"
    del block


def test_no_peak_since_a_reset_before_any_reset() -> None:
    """In a fresh process the kernel's mark is a lifetime peak, not a peak since a moment this
    process chose: ``peak_rss_bytes`` says so with ``None``, and the lifetime peak is there."""
    script = (
        "from ckpt_core.rss import lifetime_peak_rss_bytes, peak_rss_bytes, rss_bytes\n"
        "print(peak_rss_bytes(), lifetime_peak_rss_bytes() >= rss_bytes() > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["None", "True"], done.stdout + done.stderr
