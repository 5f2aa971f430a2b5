"""``finalize()`` called inside the ``except`` block that caught a failed refit releases the
cuda_ipc slots at once.

While an exception is being handled, its traceback keeps the failed refit's frames alive, and
they hold views of the shared slot buffers: collecting garbage cannot free them. The slots
(two buckets of shared memory, on both sides) must be unmapped and their file's descriptors
closed anyway, not at some later collection.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from tests.reliability.rel_inprocess import Pair


def _slot_memory() -> list[str]:
    """This process's mappings and descriptors of cuda_ipc slot files."""
    found = [line.split(None, 5)[-1].strip() for line in open("/proc/self/maps") if "ckpt-cuda-ipc-slots" in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "ckpt-cuda-ipc-slots" in target:
            found.append(f"fd {fd}: {target}")
    return found


def _failing_weights() -> Iterator[tuple[str, torch.Tensor]]:
    for i in range(6):
        yield f"w{i}", torch.full((3000,), float(i))
    raise RuntimeError("the trainer failed mid-refit")


def test_finalize_inside_the_except_block_releases_the_slots() -> None:
    assert _slot_memory() == [], "another test left slot memory behind"
    pair = Pair("cuda_ipc", engine_kwargs={"device": "cpu"})
    for outcome in pair.init_outcomes:
        outcome.get()
    assert _slot_memory(), "an initialized pair maps its slots"
    sent, received = pair.refit(_failing_weights)
    assert sent.error is not None and received.error is not None
    held: list[str] = []
    try:
        raise sent.error
    except RuntimeError:
        pair.finalize()
        held = _slot_memory()  # measured while the failure is still being handled
    assert held == [], f"finalize() in the except block left the slots: {held}"
