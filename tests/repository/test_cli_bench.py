"""``ckpt-engine bench`` end to end, in a subprocess as a user runs it: a small refit, checked
bit-exact by the bench itself, with weights made while the refit runs (``--produce``)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("mode", ["cast-bf16", "fill"])
def test_bench_refits_weights_produced_during_the_refit(mode: str) -> None:
    command = [sys.executable, "-m", "ckpt_core.cli", "bench", "--size", "4MiB", "--bucket-size", "1MiB",
               "--rollout", "1", "--refits", "1", "--no-baseline", "--no-progress", "--produce", mode]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"weights produced during the refit ({mode})" in run.stdout
    assert "bit-exact: every received tensor matched its source" in run.stdout


def test_an_unknown_produce_mode_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ckpt_core.cli", "bench", "--produce", "quantize"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "invalid choice: 'quantize'" in run.stderr
