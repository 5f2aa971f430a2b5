"""A receiver slot's rotating memory (``SlotMemories``): the blocks a slot hands over come back
to it once no tensor holds them, resident and with what was received into them, whatever the
host pool keeps; a slot never takes memory a consumer still holds."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from ckpt_core._internal import host_alloc
from ckpt_core._internal.host_alloc import HUGE_PAGE_THRESHOLD, set_host_pool_limit
from ckpt_core._internal.slot_memory import SlotMemories, SlotMemory
from ckpt_core.host_pool import release_host_memory

NBYTES = 3 * HUGE_PAGE_THRESHOLD


@pytest.fixture(params=["pool-on", "pool-off"])
def pool(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every rotation test runs with the host pool on and off (as vLLM's workers run it):
    the slot's blocks are its own either way."""
    saved = host_alloc._POOL.limit
    if request.param == "pool-off":
        set_host_pool_limit(0)
    try:
        yield request.param
    finally:
        set_host_pool_limit(saved)


def _hand_over_refits(refits: int, keep: int) -> tuple[list[int | None], list[int], list[bool]]:
    """A slot handing its memory over at each of ``refits`` refits to a consumer that keeps the
    last ``keep`` refits' tensors (views of the memory each arrived in): the address of the
    memory taken at each hand-over (``None``: refused, the bucket copied out), every address
    taken while the consumer still held it (none, if the rotation is right), and whether each
    block taken again still held the bytes last received into it (it was the same memory, not
    new memory at the same address)."""
    memories = SlotMemories()
    slot = torch.zeros(NBYTES, dtype=torch.uint8)  # the buffer made at start
    kept: list[torch.Tensor] = []
    taken: list[int | None] = []
    clashes: list[int] = []
    kept_bytes: list[bool] = []
    last_written: dict[int, int] = {}  # address -> the byte last received into it
    for refit in range(refits):
        slot[:4096].fill_(refit % 250 + 1)  # this refit's bucket arrives in the slot
        last_written[slot.data_ptr()] = refit % 250 + 1
        received = slot[64:4096]  # the bucket's tensors: views of the memory it arrived in
        new = memories.take(NBYTES)
        if new is not None:
            held = {view.untyped_storage().data_ptr() for view in kept}
            clashes += [new.data_ptr()] if new.data_ptr() in held else []
            if new.data_ptr() in last_written:
                kept_bytes.append(int(new[100]) == last_written[new.data_ptr()])
            slot = new
        else:  # copied out: the slot keeps its memory
            received = received.clone()
        taken.append(None if new is None else new.data_ptr())
        kept = [*kept, received][-keep:] if keep else []
        del received, new
        release_host_memory()  # what a rollout handing memory back after each refit does
        gc.collect()
    return taken, clashes, kept_bytes


@pytest.mark.usefixtures("pool")
def test_a_slot_whose_consumer_drops_each_refit_takes_back_the_block_it_gave_the_time_before() -> None:
    taken, clashes, kept_bytes = _hand_over_refits(8, keep=0)
    assert None not in taken and clashes == []
    assert len(set(taken[1:])) == 2 and taken[2:] == taken[:2] * 3  # two blocks, alternating
    assert kept_bytes and all(kept_bytes)


@pytest.mark.usefixtures("pool")
def test_a_slot_whose_consumer_keeps_its_last_refit_rotates_among_three_blocks() -> None:
    taken, clashes, kept_bytes = _hand_over_refits(9, keep=1)
    assert None not in taken and clashes == []
    assert len(set(taken)) == 3 and taken[3:] == taken[:3] * 2
    assert kept_bytes and all(kept_bytes)


@pytest.mark.usefixtures("pool")
def test_a_slot_whose_consumer_keeps_its_last_two_refits_rotates_among_four_blocks() -> None:
    """As vLLM's adapter store keeps the version it served before beside the one it serves: every
    bucket is handed over, never into memory the consumer still holds."""
    taken, clashes, kept_bytes = _hand_over_refits(12, keep=2)
    assert None not in taken and clashes == []
    assert len(set(taken)) == SlotMemories.ROTATION and taken[4:] == taken[:4] * 2
    assert kept_bytes and all(kept_bytes)


@pytest.mark.usefixtures("pool")
def test_a_slot_whose_consumer_keeps_every_refit_copies_once_its_rotation_is_held() -> None:
    rotation = SlotMemories.ROTATION
    taken, clashes, _ = _hand_over_refits(rotation + 3, keep=rotation + 3)
    assert clashes == [] and None not in taken[:rotation] and len(set(taken[:rotation])) == rotation
    assert taken[rotation:] == [None] * 3


def test_a_block_gives_no_second_tensor_while_a_view_of_the_first_lives() -> None:
    block = SlotMemory(NBYTES)
    tensor = block.tensor(NBYTES)
    view = tensor[5:]
    del tensor
    gc.collect()
    assert block.held
    with pytest.raises(RuntimeError, match="still held"):
        block.tensor(NBYTES)
    del view
    gc.collect()
    assert not block.held and block.tensor(NBYTES).numel() == NBYTES
    with pytest.raises(ValueError, match="cannot hold"):
        SlotMemory(4096).tensor(block.size + 1)


def test_a_tensor_outlives_the_slot_that_gave_it() -> None:
    """A receiver closed (its slots' memories dropped) while a consumer keeps tensors on a block:
    the block's memory stays mapped under them."""
    memories = SlotMemories()
    first = memories.take(NBYTES)
    assert first is not None
    first[:8].copy_(torch.arange(8, dtype=torch.uint8))
    second = memories.take(NBYTES)  # hands `first` over, as a receiver does
    del memories, second
    gc.collect()
    assert torch.equal(first[:8], torch.arange(8, dtype=torch.uint8))


def _live_blocks() -> int:
    return sum(isinstance(thing, SlotMemory) for thing in gc.get_objects())


def test_finalize_lets_a_receiver_s_slot_blocks_go() -> None:
    """A Gloo rollout that handed buckets over keeps its slots' blocks between refits (real
    engines, in this process); ``finalize()`` lets them go once no tensor holds them."""
    from tests.reliability.rel_inprocess import Pair

    gc.collect()
    before = _live_blocks()
    pair = Pair("gloo_cpu", bucket_size=64 << 10)
    try:
        for outcome in pair.init_outcomes:
            outcome.get()
        for _ in range(3):  # small tensors, several buckets a refit, received owned: handed over
            sent, received = pair.refit(lambda: [(f"w{i}", torch.full((1000,), float(i))) for i in range(60)])
            sent.get()
            assert [name for name, _ in received.get()] == [f"w{i}" for i in range(60)]
            del sent, received
        gc.collect()
        assert _live_blocks() > before, "the rollout handed no bucket over"
    finally:
        pair.finalize()
    del pair
    gc.collect()
    assert _live_blocks() == before
