"""Tensor builders and byte-level comparisons for the chunking tests.

Comparisons are on bytes, never on values: NaN payloads, negative zero, invalid float8 codes
and sub-byte dtypes all compare exactly, and nothing here depends on the code under test.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncGenerator, Iterable, Sequence

import torch

from ckpt_core import TensorMeta, merge_weight_chunk_batches

Chunk = tuple[TensorMeta, torch.Tensor]


def random_tensor(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` filled with random bytes.

    Works for every dtype (sub-byte ``uint1..7``/``int1..7``, bits, float8 ...) because it
    writes through a ``uint8`` view instead of calling dtype-specific kernels. ``bool`` gets
    only 0/1 bytes, the only valid bool values.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
        tensor = torch.empty(tuple(shape), dtype=dtype)
    raw = tensor.reshape(-1).view(torch.uint8)
    high = 2 if dtype is torch.bool else 256
    raw.copy_(torch.randint(0, high, raw.shape, dtype=torch.uint8, generator=generator))
    return tensor


def c_order_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order, gathered from its storage by stride arithmetic.

    An independent reference for non-contiguous views: it never calls ``.contiguous()`` or a
    dtype kernel, so it works for dtypes whose copy kernels torch does not implement.
    """
    if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
        return tensor.detach().reshape(-1).view(torch.uint8)  # C order is storage order
    storage = tensor.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8).set_(storage)
    size = tensor.element_size()
    elements = torch.arange(storage.nbytes() // size if size else 0)
    index = elements.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset()).reshape(-1)
    byte_index = (index[:, None] * size + torch.arange(size)).reshape(-1)
    return base[byte_index]


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Same shape, dtype and bytes (C order)."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    got, want = c_order_bytes(actual), c_order_bytes(expected)
    if not torch.equal(got, want):
        first = int((got != want).nonzero()[0, 0])
        raise AssertionError(
            f"{name}: bytes differ ({int((got != want).sum())} of {want.numel()}), first at byte {first}"
        )


def assert_same_weights(
    actual: Sequence[tuple[str, torch.Tensor]], expected: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """The same names in the same order, each tensor bit-exact."""
    assert [n for n, _ in actual] == [n for n, _ in expected]
    for (name, got), (_, want) in zip(actual, expected):
        assert_same_tensor(got, want, name)


def group_into_buckets(chunks: Iterable[Chunk]) -> list[list[Chunk]]:
    """Group a split stream by bucket: a chunk whose offset is below the previous chunk's end
    opens a new bucket (the rule of ``ckpt_core.chunking``'s module docstring)."""
    buckets: list[list[Chunk]] = []
    end: int | None = None
    for meta, chunk in chunks:
        assert meta.offset is not None, f"{meta.name}: split produced a chunk without an offset"
        if end is None or meta.offset < end:
            buckets.append([])
        buckets[-1].append((meta, chunk))
        end = meta.offset + meta.chunk_size
    return buckets


async def as_async(batches: Iterable[list[Chunk]]) -> AsyncGenerator[list[Chunk], None]:
    for batch in batches:
        yield batch


def merge_all(
    batches: Iterable[list[Chunk]] | AsyncGenerator[list[Chunk], None],
    *,
    merge_device: torch.device | str | None = None,
    received: list[list[tuple[str, torch.Tensor]]] | None = None,
) -> list[list[tuple[str, torch.Tensor]]]:
    """Run ``merge_weight_chunk_batches`` to the end and return its batches.

    ``received`` (if given) collects batches as they come, so a caller that expects an error
    can still see what was yielded before it.
    """
    out = received if received is not None else []
    source = batches if isinstance(batches, AsyncGenerator) else as_async(batches)

    async def run() -> None:
        async for batch in merge_weight_chunk_batches(source, merge_device=merge_device):
            out.append(batch)

    asyncio.run(run())
    return out


def flatten(batches: Iterable[list[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
    return [item for batch in batches for item in batch]
