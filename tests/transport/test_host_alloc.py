"""Host allocations for received tensors: huge-page mappings, the pool of freed blocks and
prefaulting."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from ckpt_core._internal import host_alloc
from ckpt_core._internal.host_alloc import (
    HUGE_PAGE_THRESHOLD,
    empty_host,
    empty_host_storage,
    host_address,
    pooled_bytes,
    prefault,
    range_storage,
    release_host_pool,
    release_pages_past,
)


def test_large_tensors_are_mapped_and_behave_like_any_tensor() -> None:
    shape = torch.Size([HUGE_PAGE_THRESHOLD // 4 + 3])
    tensor = empty_host(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    tensor.copy_(torch.arange(shape[0], dtype=torch.float32))
    assert torch.equal(tensor[-3:], torch.tensor([shape[0] - 3, shape[0] - 2, shape[0] - 1], dtype=torch.float32))


def test_prefault_keeps_what_the_pages_hold() -> None:
    tensor = empty_host(torch.Size([3 << 20]), torch.uint8)
    source = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tensor[: 1 << 20].copy_(source[: 1 << 20])  # part written before, part after
    prefault(tensor[5:])  # an unaligned start is rounded down to its page
    tensor[1 << 20 :].copy_(source[1 << 20 :])
    assert torch.equal(tensor, source)


def test_prefault_while_another_thread_writes_loses_nothing() -> None:
    nbytes = 64 << 20
    tensor = empty_host(torch.Size([nbytes]), torch.uint8)
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    writer = threading.Thread(
        target=lambda: [tensor[i : i + (1 << 20)].copy_(source[i : i + (1 << 20)]) for i in range(0, nbytes, 1 << 20)]
    )
    writer.start()
    prefault(tensor)
    writer.join()
    assert torch.equal(tensor, source)


def test_prefault_ignores_what_it_cannot_touch() -> None:
    prefault(torch.empty(0, dtype=torch.uint8))
    prefault(torch.zeros(16, dtype=torch.uint8)[3:9])


# --- the pool of freed blocks -----------------------------------------------------------------


def test_a_freed_tensor_s_memory_serves_the_next_tensor_of_its_size() -> None:
    release_host_pool()
    shape = torch.Size([HUGE_PAGE_THRESHOLD // 2])  # int16: exactly the threshold
    first = empty_host(shape, torch.int16)
    address = first.data_ptr()
    first.fill_(7)
    del first
    assert pooled_bytes() == HUGE_PAGE_THRESHOLD
    again = empty_host(shape, torch.int16)
    assert again.data_ptr() == address and pooled_bytes() == 0
    assert bool((again == 7).all())  # reused as is: an uninitialized tensor, like torch.empty
    release_host_pool()


def test_memory_stays_with_a_tensor_while_any_view_of_it_lives() -> None:
    release_host_pool()
    shape = torch.Size([HUGE_PAGE_THRESHOLD])
    tensor = empty_host(shape, torch.uint8)
    view = tensor[5:10].view(torch.int8)
    address = tensor.data_ptr()
    del tensor
    assert pooled_bytes() == 0
    other = empty_host(shape, torch.uint8)
    assert other.data_ptr() != address
    del view
    assert pooled_bytes() == HUGE_PAGE_THRESHOLD
    release_host_pool()
    assert pooled_bytes() == 0


def test_the_pool_keeps_no_more_than_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    release_host_pool()
    monkeypatch.setattr(host_alloc._POOL, "limit", 3 * HUGE_PAGE_THRESHOLD)
    tensors = [empty_host(torch.Size([HUGE_PAGE_THRESHOLD]), torch.uint8) for _ in range(5)]
    del tensors
    assert pooled_bytes() == 3 * HUGE_PAGE_THRESHOLD
    release_host_pool()


@pytest.mark.parametrize("release", [True, False], ids=["release_after_refit", "kept"])
def test_finalize_returns_pooled_memory_if_asked(release: bool) -> None:
    from ckpt_core.testing.in_process import connected_pair, run_refit

    release_host_pool()
    weights = [("big", torch.randn(HUGE_PAGE_THRESHOLD // 2))]
    policy, rollout = connected_pair(HUGE_PAGE_THRESHOLD, direct_chunks=True, release_after_refit=release)
    outcome = run_refit(policy, rollout, lambda: iter(weights))
    assert outcome.receive_error is None and torch.equal(outcome.received[0][1], weights[0][1])
    del outcome
    assert pooled_bytes() > 0
    policy.finalize()
    rollout.finalize()
    assert (pooled_bytes() == 0) is release
    release_host_pool()


def test_a_full_pool_keeps_the_most_recently_freed_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A workload that changed tensor sizes must not leave the old sizes' memory pooled."""
    release_host_pool()
    size_a, size_b = 2 * HUGE_PAGE_THRESHOLD, 3 * HUGE_PAGE_THRESHOLD
    monkeypatch.setattr(host_alloc._POOL, "limit", 2 * size_b)
    old = [empty_host(torch.Size([size_a]), torch.uint8) for _ in range(2)]
    del old
    assert pooled_bytes() == 2 * size_a
    new = [empty_host(torch.Size([size_b]), torch.uint8) for _ in range(2)]
    addresses = {t.data_ptr() for t in new}
    del new
    assert pooled_bytes() == 2 * size_b  # both size_a blocks made room
    again = [empty_host(torch.Size([size_b]), torch.uint8) for _ in range(2)]
    assert {t.data_ptr() for t in again} == addresses
    release_host_pool()


def test_shared_storages_are_pooled_beside_tensor_blocks() -> None:
    release_host_pool()
    block = empty_host(torch.Size([HUGE_PAGE_THRESHOLD]), torch.uint8)
    del block
    storage = empty_host_storage(1 << 20)
    storage.fill_(7)
    address = storage.data_ptr()
    del storage
    assert pooled_bytes() == HUGE_PAGE_THRESHOLD + (1 << 20)  # both kept, neither evicted
    again = empty_host_storage(1 << 20)
    assert again.data_ptr() == address and pooled_bytes() == HUGE_PAGE_THRESHOLD
    del again
    release_host_pool()
    assert pooled_bytes() == 0


def test_host_address_only_for_buffers_a_memmove_may_fill() -> None:
    buffer = torch.zeros(64, dtype=torch.uint8)
    assert host_address(buffer, 64) == buffer.data_ptr()
    assert host_address(buffer[8:], 56) == buffer.data_ptr() + 8
    assert host_address(buffer, 65) is None  # smaller than asked
    assert host_address(buffer[::2], 8) is None  # not contiguous
    assert host_address(buffer.view(torch.int32), 4) is None  # not bytes
    assert host_address(buffer.view(8, 8), 8) is None  # not 1-D


def test_the_public_pool_limit_evicts_at_once_and_zero_keeps_nothing() -> None:
    from ckpt_core.errors import InvalidArgumentError
    from ckpt_core.host_pool import limit_host_pool, pooled_host_bytes, release_host_memory

    release_host_memory()
    before = host_alloc._POOL.limit
    try:
        del_me = [empty_host(torch.Size([2 << 20]), torch.uint8) for _ in range(3)]
        del del_me
        assert pooled_host_bytes() >= 3 * (2 << 20)
        limit_host_pool(2 << 20)  # shrinking evicts the oldest blocks now
        assert pooled_host_bytes() <= 2 << 20
        limit_host_pool(0)
        assert pooled_host_bytes() == 0
        freed = empty_host(torch.Size([2 << 20]), torch.uint8)
        del freed
        assert pooled_host_bytes() == 0  # no pool: freed memory goes straight back
        for bad in (-1, 1.5, True, "1"):
            with pytest.raises(InvalidArgumentError, match="number of bytes"):
                limit_host_pool(bad)  # type: ignore[arg-type]
    finally:
        limit_host_pool(before)
    assert release_host_memory() == 0


def test_host_bucket_buffers_are_resident_from_the_start() -> None:
    """Touched at allocation: a worker's RSS shows them before its first refit."""
    from ckpt_core._internal.bucket_io import bucket_buffers

    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))

    before = rss()
    buffers = bucket_buffers(2, 32 << 20, torch.device("cpu"))
    assert rss() - before >= 60 << 20, "the buffers' pages are not resident yet"
    assert all(b.numel() == 32 << 20 and b.dtype == torch.uint8 for b in buffers)


def test_a_range_storage_holds_its_bytes_alone_and_keeps_the_buffer_alive() -> None:
    buffer = torch.arange(256, dtype=torch.uint8).repeat(64)
    part = range_storage(buffer, 4096, 1000)
    assert part.untyped_storage().nbytes() == 1000 and part.data_ptr() == buffer.data_ptr() + 4096
    want = buffer[4096:5096].clone()
    del buffer
    gc.collect()
    assert torch.equal(part, want)
    assert range_storage(torch.zeros(8, dtype=torch.uint8), 8, 0).numel() == 0
    with pytest.raises(ValueError, match="outside"):
        range_storage(torch.zeros(8, dtype=torch.uint8), 4, 5)


@pytest.mark.skipif(host_alloc._libc is None, reason="madvise is Linux's")
def test_pages_past_what_a_buffer_holds_go_back_and_the_rest_stays() -> None:
    page = host_alloc.mmap.PAGESIZE
    buffer = empty_host(torch.Size([64 * page]), torch.uint8)
    buffer.fill_(7)
    release_pages_past(buffer, 5 * page + 3)
    assert bool((buffer[: 6 * page] == 7).all())  # the page holding byte 5 * page + 2 stays whole
    assert bool((buffer[6 * page :] == 0).all())  # given back: zero-filled when read again
