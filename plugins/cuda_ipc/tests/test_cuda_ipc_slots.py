"""``CudaSlots`` without a GPU: the slot views alias their memory, and that memory is released
only once no view of it is left.

The slots take the memory they view as an object that ``torch.as_tensor`` wraps without a copy
and keeps alive while a view exists: in production a CUDA range (``__cuda_array_interface__``),
here a host array, with a finalizer that records the release where production frees or unmaps.
Everything else is the production class. test_cuda_ipc_gpu.py runs the same on a GPU.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ckpt_core.errors import BackendUnavailableError, EngineOptionError, WireFormatError
from ckpt_cuda_ipc.buffers import CudaSlots, check_same_gpu, slot_stride

BUCKET = 5000
CPU = torch.device("cpu")


class Memory:
    """Host memory standing in for the device range, and a record of its release."""

    def __init__(self) -> None:
        self.array: np.ndarray | None = np.zeros(slot_stride(BUCKET) * 2, dtype=np.uint8)
        self.pointer = int(self.array.ctypes.data)
        self.released: list[str] = []
        weakref.finalize(self.array, self.released.append, "released")

    def slots(self, pointer: int | None = None, device: torch.device = CPU) -> CudaSlots:
        """The slots over this memory, which they then own (as allocate() and attach() hand it over)."""
        array, self.array = self.array, None
        return CudaSlots(array, self.pointer if pointer is None else pointer, device, BUCKET, 2)


@pytest.fixture
def memory() -> Iterator[Memory]:
    enabled = gc.isenabled()
    gc.disable()  # only close() may collect: the tests say when cycles go
    try:
        yield Memory()
    finally:
        if enabled:
            gc.enable()


def test_the_slot_views_are_the_memory_itself(memory: Memory) -> None:
    array = memory.array
    assert array is not None
    slots = memory.slots()
    stride = slot_stride(BUCKET)
    slots.view(1).fill_(7)
    assert (array[stride : stride + BUCKET] == 7).all() and not array[:stride].any()
    array[:BUCKET] = 3
    assert bool((slots.view(0) == 3).all())
    assert slots.view(0).numel() == slots.view(1).numel() == BUCKET


@pytest.mark.parametrize("case", ["another address", "another device"])
def test_slots_that_would_not_alias_the_memory_are_refused(memory: Memory, case: str) -> None:
    with pytest.raises(BackendUnavailableError, match="would not alias the shared memory"):
        if case == "another address":
            memory.slots(pointer=memory.pointer + 64)
        else:
            memory.slots(device=torch.device("meta"))


def test_close_releases_the_memory_at_once_when_no_view_is_left(memory: Memory) -> None:
    slots = memory.slots()
    assert slots.mapped and memory.released == []
    slots.close()
    assert not slots.mapped and memory.released == ["released"]
    slots.close()
    assert memory.released == ["released"]


def test_close_collects_views_held_only_by_a_reference_cycle(memory: Memory) -> None:
    """Like the frames of a failed refit's traceback, which hold slot views in a cycle."""
    slots = memory.slots()
    cycle: list[object] = [slots.view(0)]
    cycle.append(cycle)
    del cycle
    slots.close()
    assert not slots.mapped and memory.released == ["released"]


def test_close_under_a_live_view_keeps_the_memory_until_the_view_dies(memory: Memory) -> None:
    """A borrowed tensor kept past finalize(): freeing under it would make reading it an
    illegal address on a GPU; the memory goes when the tensor does."""
    slots = memory.slots()
    kept = slots.view(1)
    kept.fill_(5)
    slots.close()
    assert slots.mapped and memory.released == []
    assert int(kept.sum()) == 5 * BUCKET
    del kept
    assert not slots.mapped and memory.released == ["released"]


def test_a_rollout_on_another_gpu_is_refused_naming_both() -> None:
    check_same_gpu("GPU-1111", "GPU-1111", torch.device("cuda", 3))
    with pytest.raises(
        EngineOptionError, match=r"cuda:1 is GPU GPU-2222, but policy rank 0's buffers are on GPU GPU-1111"
    ):
        check_same_gpu("GPU-1111", "GPU-2222", torch.device("cuda", 1))
    with pytest.raises(WireFormatError, match="did not say which GPU"):
        check_same_gpu(None, "GPU-2222", torch.device("cuda", 1))
