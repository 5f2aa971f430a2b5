"""The memory of a receiver's slot that hands its buffer over with the tensors in it.

A Gloo receiver that lands a bucket of small whole tensors owned gives the pipeline the slot's
buffer for good (``BucketReceiver.hand_over``): the tensors are views of it, nothing is copied
out. The slot then needs other memory for its next bucket, and memory new to the process is
slow to receive into: every page faults in, and the kernel zeroes it (on one machine here,
receiving 4.65 MB into new huge pages took 15-20 ms against 1.5-2 ms into pages already in:
docs/benchmarks.md). So a slot rotates among a few blocks of its
own (:class:`SlotMemories`): it takes back one no tensor holds any longer, resident as far as
buckets were received into it before, and makes a new one only while every block it has is
held and it has fewer than :attr:`SlotMemories.ROTATION`.

The blocks are the slot's, not the host pool's: they stay mapped while the slot lives, whatever
the pool keeps (an inference engine turns the pool off to keep its memory down, which gave each
freed block back to the system and every hand-over new memory), and go when the receiver is
closed and the last tensor on them is freed.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Any

import torch

from ckpt_core._internal.host_alloc import mapping_size, new_mapping

_BLOCK_TYPES: dict[int, type] = {}


def _block_type(size: int) -> Any:
    """A ctypes byte array type of ``size`` whose instances take weak references: the block a
    slot's tensor is made on, alive as long as any view of that tensor is."""
    block_type = _BLOCK_TYPES.get(size)
    if block_type is None:
        block_type = _BLOCK_TYPES[size] = type("SlotBlock", (ctypes.c_ubyte * size,), {})
    return block_type


class SlotMemory:
    """One block of a slot's memory: an anonymous mapping of :attr:`size` bytes, kept mapped for
    as long as this object or a tensor on it lives, and whether a tensor on it still does."""

    __slots__ = ("size", "_mapping", "_block")

    def __init__(self, nbytes: int) -> None:
        self.size = mapping_size(nbytes)
        self._mapping: mmap.mmap = new_mapping(self.size)
        self._block: weakref.ref[Any] | None = None

    @property
    def held(self) -> bool:
        """Whether a tensor :meth:`tensor` made (any view of it) is still alive."""
        return self._block is not None and self._block() is not None

    def tensor(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` tensor on the block's first ``nbytes`` (at most :attr:`size`), holding
        what was last written there (uninitialized where nothing was). Only while not
        :attr:`held`: two live tensors on one block would share their bytes."""
        if nbytes > self.size:
            raise ValueError(f"a slot block of {self.size} bytes cannot hold {nbytes}")
        if self.held:
            raise RuntimeError("this slot block is still held by a tensor on it")
        block = _block_type(self.size).from_buffer(self._mapping)  # keeps the mapping alive too
        self._block = weakref.ref(block)
        return torch.frombuffer(block, dtype=torch.uint8, count=nbytes)


class SlotMemories:
    """The memory of one receiver slot that hands its memory over with the tensors in it
    (``BucketReceiver.hand_over``; module docstring), rotating among at most :attr:`ROTATION`
    blocks of its own: the one the slot receives into, and those it handed over before, which
    their consumer holds until it drops them.

    A consumer that drops each refit frees the block given the time before, and that one is
    taken back. One that keeps its last refit holds that block, and the one before it is taken;
    one that keeps its last two (vLLM's adapter store keeps the version it served before beside
    the one it serves, until the next arrives) holds two, and the third is taken. Only a slot
    whose rotation is full and held (a consumer keeping three refits or more) is refused: the
    bucket is copied out then, and the slot keeps its memory."""

    ROTATION = 4

    __slots__ = ("current", "_given")

    def __init__(self) -> None:
        self.current: SlotMemory | None = None
        """The block the slot holds now; ``None``: the memory it was made with."""
        self._given: list[SlotMemory] = []  # the blocks the slot handed over, the most recent first

    def take(self, nbytes: int) -> torch.Tensor | None:
        """New memory of ``nbytes`` for the slot, which hands over its current memory (a 1-D
        ``uint8`` CPU tensor, holding whatever was received into it before): the most recently
        handed-over block no tensor holds, else (while the rotation is not full) a new block;
        ``None`` when every block of a full rotation is held."""
        free = next((block for block in self._given if not block.held and block.size >= nbytes), None)
        if free is None:
            if len(self._given) >= self.ROTATION - 1:
                return None
            free = SlotMemory(nbytes)
        else:
            self._given.remove(free)
        if self.current is not None:
            self._given.insert(0, self.current)
        self.current = free
        return free.tensor(nbytes)
