"""Host allocations for received tensors: huge-page mappings and prefaulting."""

from __future__ import annotations

import threading

import torch

from ckpt_core.host_memory import HUGE_PAGE_THRESHOLD, empty_host, prefault


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
    writer = threading.Thread(target=lambda: [tensor[i : i + (1 << 20)].copy_(source[i : i + (1 << 20)]) for i in range(0, nbytes, 1 << 20)])
    writer.start()
    prefault(tensor)
    writer.join()
    assert torch.equal(tensor, source)


def test_prefault_ignores_what_it_cannot_touch() -> None:
    prefault(torch.empty(0, dtype=torch.uint8))
    prefault(torch.zeros(16, dtype=torch.uint8)[3:9])
