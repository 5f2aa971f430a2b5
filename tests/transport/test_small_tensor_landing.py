"""``SmallTensorLander``: small whole tensors of a received buffer land as views of shared
storages, bit-exact, in order, never aliasing the buffer, and refusing what it cannot place."""

from __future__ import annotations

import pytest
import torch

from ckpt_core import split_weight_chunks
from ckpt_core._internal.assembly import SHARED_STORAGE_BYTES, ChunkAssembler, Landing, SmallTensorLander
from ckpt_core.errors import ChunkStreamError
from tests.helpers.tensors import assert_same_tensor, random_tensor

CPU = torch.device("cpu")

SHAPES_AND_DTYPES = [
    ((), torch.float32),
    ((0,), torch.float32),
    ((3, 0, 2), torch.bfloat16),
    ((7,), torch.bool),
    ((5, 3), torch.float16),
    ((2, 3, 4), torch.int64),
    ((9,), torch.uint8),
    ((4,), torch.complex64),
    ((1, 1), torch.float64),
    ((33,), torch.int8),
]


def packed(weights: list[tuple[str, torch.Tensor]], bucket_size: int = 1 << 22) -> tuple[torch.Tensor, list[Landing]]:
    """The weights laid out in one buffer at their ``split_weight_chunks`` offsets, and a
    landing planned for each."""
    buffer = torch.zeros(bucket_size, dtype=torch.uint8)
    assembler = ChunkAssembler()
    landings = []
    for meta, chunk in split_weight_chunks((item for item in weights), bucket_size):
        assert meta.offset is not None
        buffer[meta.offset : meta.offset + meta.chunk_size] = chunk
        landings.append(assembler.plan(meta, CPU))
    assembler.finish()
    return buffer, landings


def offsets_of(landings: list[Landing]) -> list[int]:
    """Each landing's offset in the packed buffer (``packed`` placed every chunk)."""
    offsets = [landing.meta.offset for landing in landings]
    assert all(offset is not None for offset in offsets)
    return [offset for offset in offsets if offset is not None]


def land(buffer: torch.Tensor, landings: list[Landing], offsets: list[int]) -> list[tuple[str, torch.Tensor]]:
    lander = SmallTensorLander(buffer)
    assert all(lander.add(landing, offset) for landing, offset in zip(landings, offsets))
    return lander.flush()


def test_small_tensors_land_bit_exact_in_order_sharing_storages() -> None:
    rng = torch.Generator().manual_seed(0)
    weights = [
        (f"w{i}", random_tensor(shape, dtype, rng)) for i in range(30) for shape, dtype in [SHAPES_AND_DTYPES[i % 10]]
    ]
    buffer, landings = packed(weights)
    landed = land(buffer, landings, offsets_of(landings))

    assert [name for name, _ in landed] == [name for name, _ in weights]
    for (name, actual), (_, expected) in zip(landed, weights):
        assert_same_tensor(actual, expected, name)
        assert actual.is_contiguous()
    storages = {tensor.untyped_storage().data_ptr() for _, tensor in landed}
    assert len(storages) == 1  # one run: one allocation for all 30

    buffer.fill_(0xFF)  # the buffer is refilled for the next bucket: landed tensors keep their bytes
    for (name, actual), (_, expected) in zip(landed, weights):
        assert_same_tensor(actual, expected, name)


def test_a_run_longer_than_one_storage_is_split() -> None:
    rng = torch.Generator().manual_seed(1)
    count = 3 * SHARED_STORAGE_BYTES // (60 << 10) + 1
    weights = [(f"big{i}", random_tensor((15 << 10,), torch.float32, rng)) for i in range(count)]  # 60 KiB each
    buffer, landings = packed(weights, bucket_size=8 << 20)
    landed = land(buffer, landings, offsets_of(landings))
    for (name, actual), (_, expected) in zip(landed, weights):
        assert_same_tensor(actual, expected, name)
    storages = {tensor.untyped_storage().data_ptr() for _, tensor in landed}
    assert 3 <= len(storages) <= 4


def test_offsets_that_go_backwards_start_a_new_run() -> None:
    """Chunks announced out of order in the buffer (a header may place them anywhere) still
    land from their own bytes."""
    rng = torch.Generator().manual_seed(2)
    weights = [(f"w{i}", random_tensor((16,), torch.int32, rng)) for i in range(4)]
    buffer, landings = packed(weights)
    offsets = offsets_of(landings)
    # Move the first tensor's bytes after the last one's, and say so.
    first, last_end = offsets[0], offsets[-1] + 64
    buffer[last_end : last_end + 64] = buffer[first : first + 64].clone()
    buffer[first : first + 64] = 0
    moved = [last_end, *offsets[1:]]
    landed = land(buffer, landings, moved)
    for (name, actual), (_, expected) in zip(landed, weights):
        assert_same_tensor(actual, expected, name)


def test_a_misaligned_offset_is_left_to_the_caller() -> None:
    weights = [("f", torch.arange(4, dtype=torch.float32))]
    buffer, (landing,) = packed(weights)
    assert not SmallTensorLander(buffer).add(landing, 2)  # a float32 at byte 2: not viewable in place


def test_large_or_partial_chunks_are_left_to_the_caller() -> None:
    weights = [("large", torch.zeros(SHARED_STORAGE_BYTES // 4, dtype=torch.float32))]
    buffer, landings = packed(weights, bucket_size=SHARED_STORAGE_BYTES // 2)  # two chunks
    lander = SmallTensorLander(buffer)
    assert not any(lander.add(landing, 0) for landing in landings)
    assert lander.flush() == []


def test_a_chunk_outside_the_buffer_is_refused() -> None:
    weights = [("f", torch.arange(4, dtype=torch.float32))]
    buffer, (landing,) = packed(weights, bucket_size=64)
    with pytest.raises(ChunkStreamError, match="outside the 64-byte buffer"):
        SmallTensorLander(buffer).add(landing, 56)
