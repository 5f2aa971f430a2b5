"""``merge_weight_chunk_batches``: batch boundaries, memory ownership, devices, and the
``ChunkStreamError`` every malformed stream must get (never a partly filled tensor)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest
import torch

from ckpt_core import TensorMeta, split_weight_chunks
from ckpt_core.errors import ChunkStreamError
from tests.helpers.tensors import (
    Chunk,
    assert_same_tensor,
    assert_same_weights,
    flatten,
    group_into_buckets,
    merge_all,
    random_tensor,
)


def chunks_of(weights: list[tuple[str, torch.Tensor]], bucket_size: int) -> list[Chunk]:
    return list(split_weight_chunks((item for item in weights), bucket_size))


# --- batch boundaries ------------------------------------------------------------------------


def test_one_output_batch_per_input_batch_that_completes_tensors(rng: torch.Generator) -> None:
    weights = [
        ("a", random_tensor((3,), torch.float32, rng)),  # 12 bytes
        ("b", random_tensor((20,), torch.float32, rng)),  # 80 bytes, spans buckets
        ("c", random_tensor((0,), torch.float32, rng)),
        ("d", random_tensor((2,), torch.float64, rng)),
        ("e", random_tensor((), torch.int8, rng)),
    ]
    buckets = group_into_buckets(chunks_of(weights, 32))
    expected_names = []
    for bucket in buckets:
        done = [m.name for m, _ in bucket if m.chunk_offset + m.chunk_size == m.nbytes]
        if done:
            expected_names.append(done)
    assert len(expected_names) < len(buckets), "the layout should have buckets that complete nothing"
    out = merge_all(buckets)
    assert [[n for n, _ in batch] for batch in out] == expected_names
    assert_same_weights(flatten(out), weights)


def test_empty_input_batches_yield_nothing(rng: torch.Generator) -> None:
    weights = [("a", random_tensor((4,), torch.int16, rng))]
    chunks = chunks_of(weights, 64)
    out = merge_all([[], chunks, [], []])
    assert len(out) == 1 and [n for n, _ in out[0]] == ["a"]
    assert merge_all([]) == []


def test_input_batches_need_not_match_buckets(rng: torch.Generator) -> None:
    weights = [(f"t{i}", random_tensor((i + 1,), torch.float16, rng)) for i in range(6)]
    chunks = chunks_of(weights, 8)
    singles = [[c] for c in chunks]  # one chunk per batch
    out = merge_all(singles)
    assert all(len(batch) == 1 for batch in out)
    assert_same_weights(flatten(out), weights)


# --- memory ownership and devices ------------------------------------------------------------


def test_outputs_own_their_memory_when_the_producer_reuses_its_buffer(rng: torch.Generator) -> None:
    """A receiver reuses one bucket buffer; tensors already yielded must not change."""
    weights = [(f"w{i}", random_tensor((5, 3), torch.float32, rng)) for i in range(8)]
    bucket_size = 64
    buckets = group_into_buckets(chunks_of(weights, bucket_size))
    buffer = torch.empty(bucket_size, dtype=torch.uint8)

    async def reusing_producer() -> AsyncGenerator[list[Chunk], None]:
        for bucket in buckets:
            buffer.fill_(0xA5)
            batch = []
            for meta, chunk in bucket:
                assert meta.offset is not None
                view = buffer[meta.offset : meta.offset + meta.chunk_size]
                view.copy_(chunk)
                batch.append((meta, view))
            yield batch
        buffer.fill_(0x5A)

    out = merge_all(reusing_producer())
    buffer_ptr = buffer.untyped_storage().data_ptr()
    for _, tensor in flatten(out):
        assert tensor.untyped_storage().data_ptr() != buffer_ptr
    assert_same_weights(flatten(out), weights)


def test_single_chunk_outputs_do_not_alias_the_chunk(rng: torch.Generator) -> None:
    source = random_tensor((4, 4), torch.float64, rng)
    expected = source.clone()
    chunks = chunks_of([("w", source)], 1 << 20)
    assert len(chunks) == 1
    ((name, tensor),) = flatten(merge_all([chunks]))
    chunks[0][1].fill_(0)  # the chunk is a view of `source`
    assert_same_tensor(tensor, expected, name)


@pytest.mark.parametrize("merge_device", ["cpu", torch.device("cpu"), None])
def test_merge_device_cpu(merge_device: torch.device | str | None, rng: torch.Generator) -> None:
    weights = [("a", random_tensor((3, 2), torch.bfloat16, rng))]
    out = flatten(merge_all([chunks_of(weights, 5)], merge_device=merge_device))
    assert out[0][1].device == torch.device("cpu")
    assert_same_weights(out, weights)


def test_merge_device_moves_only_tensors_split_over_chunks(rng: torch.Generator) -> None:
    """NeMo RL's meaning: a tensor one chunk carries whole stays on the chunk's device; only
    tensors assembled from several chunks are built on ``merge_device``. The ``meta`` device
    makes the difference visible without a GPU."""
    weights = [
        ("whole", random_tensor((3,), torch.float32, rng)),
        ("split", random_tensor((40,), torch.float32, rng)),
        ("empty", torch.empty(0)),
    ]
    out = dict(flatten(merge_all([chunks_of(weights, 64)], merge_device="meta")))
    assert out["whole"].device.type == "cpu" and out["empty"].device.type == "cpu"
    assert out["split"].device.type == "meta" and out["split"].shape == (40,)
    assert_same_tensor(out["whole"], weights[0][1], "whole")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_merge_device_cpu_keeps_split_tensors_off_the_gpu(rng: torch.Generator) -> None:
    """What NeMo RL's NIXL engine relies on: chunks in a GPU buffer, ``merge_device="cpu"``."""
    weights = [("a", random_tensor((3, 2), torch.bfloat16, rng)), ("b", random_tensor((64,), torch.float32, rng))]
    chunks = [(meta, chunk.cuda()) for meta, chunk in chunks_of(weights, 64)]
    out = dict(flatten(merge_all([chunks], merge_device="cpu")))
    assert out["a"].device.type == "cuda" and out["b"].device.type == "cpu"
    assert_same_weights([(n, out[n].cpu()) for n, _ in weights], weights)


# --- malformed streams -----------------------------------------------------------------------

# "first" is 64 bytes cut into four 16-byte chunks by 16-byte buckets; "done" precedes it in its
# own batch, so every malformed stream below has a good batch to yield before the bad one.
BUCKET = 16


@dataclasses.dataclass
class Stream:
    done: list[Chunk]
    first: list[Chunk]
    rest: list[Chunk]


def make_stream(rng: torch.Generator) -> Stream:
    done = chunks_of([("done", random_tensor((2,), torch.float32, rng))], BUCKET)
    first = chunks_of([("first", random_tensor((4, 4), torch.float32, rng))], BUCKET)
    rest = chunks_of([("rest", random_tensor((2,), torch.float32, rng))], BUCKET)
    assert len(done) == 1 and len(first) == 4 and len(rest) == 1
    return Stream(done, first, rest)


def replace_meta(chunk: Chunk, **changes: Any) -> Chunk:
    return dataclasses.replace(chunk[0], **changes), chunk[1]


def _swap(s: Stream) -> list[Chunk]:
    return [s.first[0], s.first[2], s.first[1], s.first[3]]


MALFORMED: dict[str, tuple[Callable[[Stream], list[Chunk]], list[str]]] = {
    "name changes mid-tensor": (
        lambda s: [s.first[0], replace_meta(s.first[1], name="other"), *s.first[2:]],
        ["'first'", "'other'", "16"],
    ),
    "shape changes mid-tensor": (
        lambda s: [s.first[0], replace_meta(s.first[1], shape=torch.Size([2, 8])), *s.first[2:]],
        ["'first'", "[4, 4]", "[2, 8]", "16"],
    ),
    "dtype changes mid-tensor": (
        lambda s: [s.first[0], replace_meta(s.first[1], dtype=torch.int32), *s.first[2:]],
        ["'first'", "float32", "int32", "16"],
    ),
    "next tensor starts before this one ends": (
        lambda s: [s.first[0], s.first[1], *s.rest],
        ["'first'", "'rest'", "32", "64"],
    ),
    "gap": (lambda s: [s.first[0], s.first[2], s.first[3]], ["'first'", "gap", "16", "32"]),
    "overlap": (lambda s: [s.first[0], s.first[1], s.first[1], *s.first[2:]], ["'first'", "overlap", "32", "16"]),
    "out of order": (_swap, ["'first'", "16", "32"]),
    "first chunk not at offset 0": (lambda s: s.first[1:], ["'first'", "16", "0"]),
    "chunk shorter than its size": (
        lambda s: [s.first[0], (s.first[1][0], s.first[1][1][:10]), *s.first[2:]],
        ["'first'", "16", "10"],
    ),
    "chunk longer than its size": (
        lambda s: [s.first[0], (s.first[1][0], torch.zeros(20, dtype=torch.uint8)), *s.first[2:]],
        ["'first'", "16", "20"],
    ),
    "chunk not uint8": (
        lambda s: [s.first[0], (s.first[1][0], s.first[1][1].view(torch.float32)), *s.first[2:]],
        ["'first'", "16", "uint8"],
    ),
    "chunk not 1-D": (
        lambda s: [s.first[0], (s.first[1][0], s.first[1][1].view(4, 4)), *s.first[2:]],
        ["'first'", "16", "1-D"],
    ),
    "chunk runs past the tensor": (
        lambda s: [*s.first[:3], (replace_meta(s.first[3], chunk_size=32)[0], torch.zeros(32, dtype=torch.uint8))],
        ["'first'", "48", "80", "64"],
    ),
    "stream ends mid-tensor": (lambda s: s.first[:3], ["'first'", "48", "64"]),
    "stream ends after the first chunk": (lambda s: s.first[:1], ["'first'", "16", "64"]),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
@pytest.mark.parametrize("split_batches", [False, True], ids=["one-batch", "batch-per-chunk"])
def test_malformed_stream(case: str, split_batches: bool, rng: torch.Generator) -> None:
    build, fragments = MALFORMED[case]
    stream = make_stream(rng)
    bad = build(stream)
    batches = [stream.done] + ([[c] for c in bad] if split_batches else [bad])
    received: list[list[tuple[str, torch.Tensor]]] = []
    with pytest.raises(ChunkStreamError) as info:
        merge_all(batches, received=received)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} missing from {message!r}"
    # Only whole, correct tensors were yielded before the error: never a partly filled one.
    assert [[n for n, _ in b] for b in received] == [["done"]]
    assert_same_tensor(received[0][0][1], stream.done[0][1].view(torch.float32), "done")


def test_malformed_chunk_in_a_batch_hides_its_completed_tensors(rng: torch.Generator) -> None:
    """A batch that fails mid-way yields none of its tensors (nothing partial escapes)."""
    stream = make_stream(rng)
    batch = [*stream.done, stream.first[0], stream.first[2]]
    received: list[list[tuple[str, torch.Tensor]]] = []
    with pytest.raises(ChunkStreamError, match="gap"):
        merge_all([batch], received=received)
    assert received == []


def test_chunk_stream_error_is_a_value_error(rng: torch.Generator) -> None:
    stream = make_stream(rng)
    with pytest.raises(ValueError):
        merge_all([stream.first[:2]])


def test_a_valid_stream_after_the_malformed_cases_still_merges(rng: torch.Generator) -> None:
    stream = make_stream(rng)
    out = flatten(merge_all([stream.done, stream.first, stream.rest]))
    assert [n for n, _ in out] == ["done", "first", "rest"]
    assert out[1][1].shape == torch.Size([4, 4]) and out[1][1].dtype == torch.float32


def test_metadata_mismatch_with_zero_sized_chunk(rng: torch.Generator) -> None:
    """A zero-size chunk that claims a non-empty tensor cannot complete it."""
    meta = TensorMeta("w", torch.Size([2]), torch.float32, 0, 0, 0)
    with pytest.raises(ChunkStreamError, match="'w'.*0.* of 8"):
        merge_all([[(meta, torch.empty(0, dtype=torch.uint8))]])
