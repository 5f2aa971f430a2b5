"""``split_weight_chunks``: the chunk layout contract, and split -> merge round trips.

The layout rules checked by :func:`assert_layout` are the ones in ``ckpt_core.chunking``'s module
docstring; every round trip here also checks them, so a layout regression fails loudly even
when the bytes still arrive.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ckpt_core import TensorMeta, split_weight_chunks
from ckpt_core.chunking import BucketPlan, split_weight_chunks_bounded
from ckpt_core.errors import UnsupportedTensorError
from ckpt_core.tensors import dtype_name, transferable_dtypes
from tests.helpers.tensors import (
    Chunk,
    assert_same_weights,
    c_order_bytes,
    flatten,
    group_into_buckets,
    merge_all,
    random_tensor,
)

ALL_DTYPES = transferable_dtypes()


def split(weights: Sequence[tuple[str, torch.Tensor]], bucket_size: int) -> list[Chunk]:
    return list(split_weight_chunks((w for w in weights), bucket_size))


def assert_layout(chunks: Sequence[Chunk], weights: Sequence[tuple[str, torch.Tensor]], bucket_size: int) -> None:
    """Check ``chunks`` against the documented layout of ``weights`` in ``bucket_size`` buckets.

    * every tensor, in order, as consecutive chunks covering its bytes exactly once; a
      zero-element tensor as exactly one chunk of size 0; no empty chunk otherwise;
    * each chunk a 1-D ``uint8`` tensor equal to the tensor's C-order bytes at its place;
    * chunks inside the bucket (``offset + chunk_size <= bucket_size``);
    * offsets, chunk offsets and sizes on element boundaries when an element fits a bucket;
    * a chunk whose offset is below the previous chunk's end opens a new bucket at offset 0,
      and only when the previous bucket had no room left for an element; every other chunk
      follows the previous one with less than one element of padding.
    """
    position = 0  # index into weights of the tensor being cut
    done = 0  # bytes of it covered so far
    end: int | None = None  # end of the previous chunk in its bucket
    for index, (meta, chunk) in enumerate(chunks):
        where = f"chunk {index} ({meta})"
        assert isinstance(meta, TensorMeta), where
        assert position < len(weights), f"{where}: more chunks than tensors"
        name, tensor = weights[position]
        assert (meta.name, meta.shape, meta.dtype) == (name, tensor.shape, tensor.dtype), where
        assert meta.nbytes == tensor.numel() * tensor.element_size(), where
        # where the chunk's bytes come from
        assert meta.chunk_offset == done, f"{where}: expected chunk_offset {done}"
        assert meta.chunk_size > 0 or meta.nbytes == 0, f"{where}: empty chunk of a non-empty tensor"
        assert chunk.dtype == torch.uint8 and chunk.dim() == 1 and chunk.numel() == meta.chunk_size, where
        expected = c_order_bytes(tensor)[meta.chunk_offset : meta.chunk_offset + meta.chunk_size]
        assert torch.equal(chunk, expected), f"{where}: bytes differ from the tensor's"
        # where the chunk goes
        itemsize = meta.dtype.itemsize
        align = itemsize if itemsize <= bucket_size else 1
        assert meta.offset is not None and meta.offset >= 0, where
        assert meta.offset + meta.chunk_size <= bucket_size, f"{where}: crosses the bucket end {bucket_size}"
        assert meta.offset % align == 0, f"{where}: offset not aligned to {align}"
        assert meta.chunk_offset % align == 0 and meta.chunk_size % align == 0, (
            f"{where}: chunk boundary inside an element of {align} bytes"
        )
        if end is None:
            assert meta.offset == 0, f"{where}: the first bucket starts at offset 0"
        elif meta.offset < end:  # opens a new bucket
            assert meta.offset == 0, f"{where}: a chunk opening a bucket sits at offset 0"
            room = bucket_size - math.ceil(end / align) * align
            if meta.chunk_size:
                assert room < align, f"{where}: opened a bucket while {room} bytes were left"
        else:
            assert meta.offset < end + align, f"{where}: {meta.offset - end} bytes of padding after {end}"
        end = meta.offset + meta.chunk_size
        done += meta.chunk_size
        if done == meta.nbytes:
            position, done = position + 1, 0
    assert position == len(weights) and done == 0, f"stream ended at tensor {position} byte {done}"


def round_trip(weights: Sequence[tuple[str, torch.Tensor]], bucket_size: int) -> list[Chunk]:
    """Split, check the layout, merge bucket by bucket, and check the result bit-exact."""
    chunks = split(weights, bucket_size)
    assert_layout(chunks, weights, bucket_size)
    assert_same_weights(flatten(merge_all(group_into_buckets(chunks))), weights)
    return chunks


# --- every dtype, every shape kind ---------------------------------------------------------


def test_transferable_dtypes_cover_the_exotic_ones() -> None:
    names = {dtype_name(d) for d in ALL_DTYPES}
    for expected in ("bool", "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                     "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "uint1", "int7", "bfloat16"):  # fmt: skip
        assert expected in names
    assert not names & {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
def test_round_trip_every_dtype(dtype: torch.dtype, rng: torch.Generator) -> None:
    weights = [
        ("matrix", random_tensor((5, 3), dtype, rng)),
        ("scalar", random_tensor((), dtype, rng)),
        ("empty", random_tensor((0, 4), dtype, rng)),
        ("vector", random_tensor((7,), dtype, rng)),
    ]
    for bucket_size in (1, 3, 16, 4096):
        round_trip(weights, bucket_size)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
def test_round_trip_non_contiguous_views(dtype: torch.dtype, rng: torch.Generator) -> None:
    base = random_tensor((6, 8), dtype, rng)
    weights = [
        ("transposed", base.t()),
        ("column_step", base[:, ::3]),
        ("row_step", base[1::2]),
        ("expanded", base[0:1].expand(3, 8)),
    ]
    assert not any(t.is_contiguous() for _, t in weights)
    # Sub-byte dtypes (uint1..7, int1..7) have no copy kernel: .contiguous() alone fails on them.
    round_trip(weights, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.complex128, torch.bool], ids=dtype_name)
def test_zero_element_tensors_are_one_empty_chunk(dtype: torch.dtype, rng: torch.Generator) -> None:
    weights = [
        ("before", random_tensor((3,), dtype, rng)),
        ("empty_1d", torch.empty(0, dtype=dtype)),
        ("empty_3d", torch.empty(4, 0, 2, dtype=dtype)),
        ("after", random_tensor((2,), dtype, rng)),
    ]
    for bucket_size in (1, 5, 1024):
        chunks = round_trip(weights, bucket_size)
        for name in ("empty_1d", "empty_3d"):
            mine = [m for m, _ in chunks if m.name == name]
            assert len(mine) == 1 and mine[0].chunk_size == 0 and mine[0].chunk_offset == 0


def test_only_zero_element_tensors(rng: torch.Generator) -> None:
    weights = [(f"e{i}", torch.empty(0, i, dtype=torch.float64)) for i in range(4)]
    chunks = round_trip(weights, 8)
    assert [m.chunk_size for m, _ in chunks] == [0, 0, 0, 0]


def test_scalars_keep_zero_dimensions(rng: torch.Generator) -> None:
    weights = [(f"s{i}", random_tensor((), d, rng)) for i, d in enumerate(ALL_DTYPES)]
    chunks = round_trip(weights, 64)
    assert all(m.shape == torch.Size([]) for m, _ in chunks)


def test_parameters_and_tensors_requiring_grad(rng: torch.Generator) -> None:
    weight = torch.nn.Parameter(random_tensor((4, 4), torch.float32, rng))
    computed = weight * 2  # has a grad_fn
    round_trip([("param", weight), ("computed", computed)], 24)


def test_conjugate_and_negative_views_arrive_resolved() -> None:
    """``conj()`` and ``_neg_view`` only set a bit; the values they stand for must arrive."""
    base = torch.tensor([1 + 2j, -3 - 4j, 5.5 + 0j], dtype=torch.complex64)
    conj = base.conj()
    negative = torch._neg_view(torch.tensor([1.0, -2.0, 0.0]))
    assert conj.is_conj() and negative.is_neg()
    conj_t = base.reshape(3, 1).conj().t()  # conjugate and non-contiguous
    chunks = split([("conj", conj), ("neg", negative), ("conj.T", conj_t)], 64)
    merged = flatten(merge_all(group_into_buckets(chunks)))
    expected = [("conj", conj.resolve_conj()), ("neg", negative.resolve_neg()), ("conj.T", conj_t.resolve_conj())]
    assert_same_weights(merged, expected)


# --- sizes relative to the bucket ------------------------------------------------------------


def test_tensor_ten_times_the_bucket(rng: torch.Generator) -> None:
    tensor = random_tensor((2500,), torch.float32, rng)  # 10_000 bytes
    chunks = round_trip([("big", tensor)], 1000)
    assert [m.chunk_size for m, _ in chunks] == [1000] * 10
    assert [m.offset for m, _ in chunks] == [0] * 10


def test_bucket_not_a_multiple_of_the_element_size(rng: torch.Generator) -> None:
    tensor = random_tensor((2500,), torch.float32, rng)
    chunks = round_trip([("big", tensor)], 1002)
    assert [m.chunk_size for m, _ in chunks] == [1000] * 10  # whole elements only


def test_element_larger_than_the_bucket(rng: torch.Generator) -> None:
    tensor = random_tensor((3,), torch.complex128, rng)  # 16-byte elements
    chunks = round_trip([("c", tensor)], 5)
    assert [m.chunk_size for m, _ in chunks] == [5] * 9 + [3]


def test_one_byte_buckets(rng: torch.Generator) -> None:
    weights = [("f", random_tensor((2,), torch.float32, rng)), ("b", random_tensor((3,), torch.bool, rng))]
    chunks = round_trip(weights, 1)
    assert [m.chunk_size for m, _ in chunks] == [1] * 11


def test_ten_thousand_tiny_tensors(rng: torch.Generator) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool]
    values = random_tensor((10_000 * 8,), torch.uint8, rng)
    weights = []
    for i in range(10_000):
        dtype = dtypes[i % len(dtypes)]
        weights.append((f"layer.{i}.w", values[i * 8 : i * 8 + 8].view(dtype)[: 1 + i % 2].clone()))
    weights = [(n, t.clamp(0, 1) if t.dtype is torch.bool else t) for n, t in weights]
    chunks = round_trip(weights, 4096)
    assert len({m.name for m, _ in chunks}) == 10_000


def test_alignment_padding_between_tensors(rng: torch.Generator) -> None:
    weights = [
        ("byte", random_tensor((3,), torch.uint8, rng)),
        ("double", random_tensor((2,), torch.float64, rng)),
        ("half", random_tensor((1,), torch.float16, rng)),
        ("int", random_tensor((1,), torch.int32, rng)),
    ]
    chunks = round_trip(weights, 64)
    assert [m.offset for m, _ in chunks] == [0, 8, 24, 28]


# --- chunks are views ------------------------------------------------------------------------


def test_chunks_of_a_contiguous_tensor_share_its_storage(rng: torch.Generator) -> None:
    storage_owner = random_tensor((40, 10), torch.float32, rng)
    tensor = storage_owner[5:25]  # contiguous, with a storage offset
    chunks = split([("w", tensor)], 96)
    assert len(chunks) > 1
    for meta, chunk in chunks:
        assert chunk.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        assert chunk.data_ptr() == tensor.data_ptr() + meta.chunk_offset


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket_size", [0, -1, -4096, 1.5, 4096.0, True, False, "4096", None])
def test_bad_bucket_size_is_a_value_error(bucket_size: object) -> None:
    with pytest.raises(ValueError, match="bucket_size"):
        split_weight_chunks(iter([("w", torch.zeros(2))]), bucket_size)  # type: ignore[arg-type]


def _bad_items() -> list[tuple[str, object]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and CSR tensors warn that they are deprecated/beta
        quantized = torch.quantize_per_tensor(torch.ones(4), scale=0.5, zero_point=1, dtype=torch.qint8)
        csr = torch.eye(3).to_sparse_csr()
    return [
        ("not a pair", torch.zeros(3)),
        ("triple", ("w", torch.zeros(3), 1)),
        ("list pair", ["w", torch.zeros(3)]),
        ("numpy", ("w", torch.zeros(3).numpy())),
        ("list value", ("w", [1.0, 2.0])),
        ("int name", (7, torch.zeros(3))),
        ("bytes name", (b"w", torch.zeros(3))),
        ("none name", (None, torch.zeros(3))),
        ("quantized", ("q", quantized)),
        ("sparse coo", ("s", torch.eye(3).to_sparse())),
        ("sparse csr", ("s", csr)),
        ("meta", ("m", torch.empty(3, device="meta"))),
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("label,item", _bad_items(), ids=[label for label, _ in _bad_items()])
def test_unsupported_items_raise(label: str, item: object, rng: torch.Generator) -> None:
    good = ("ok", random_tensor((2,), torch.float32, rng))
    stream = split_weight_chunks((w for w in [good, item]), 64)  # type: ignore[misc]
    first = next(stream)
    assert first[0].name == "ok"
    with pytest.raises(UnsupportedTensorError):
        next(stream)


def test_unsupported_error_names_the_weight() -> None:
    with pytest.raises(UnsupportedTensorError, match="'layer.0.sparse'.*to_dense"):
        split([("layer.0.sparse", torch.eye(3).to_sparse())], 64)


# --- property test ---------------------------------------------------------------------------

_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)
_weights = st.lists(st.tuples(_shapes, st.sampled_from(ALL_DTYPES), st.booleans()), min_size=0, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=_weights, bucket_size=st.integers(1, 96), seed=st.integers(0, 2**31))
def test_property_round_trip_and_layout(
    weights: list[tuple[list[int], torch.dtype, bool]], bucket_size: int, seed: int
) -> None:
    rng = torch.Generator().manual_seed(seed)
    named = []
    for i, (shape, dtype, transpose) in enumerate(weights):
        tensor = random_tensor(shape, dtype, rng)
        if transpose and tensor.dim() >= 2:
            tensor = tensor.transpose(0, -1)
        named.append((f"w{i}", tensor))
    round_trip(named, bucket_size)


def test_bounded_split_opens_a_bucket_every_max_chunks(rng: torch.Generator) -> None:
    """The pipeline's layout: the same chunks as ``split_weight_chunks``, with a new bucket
    (offset 0) after every ``max_chunks`` chunks, so packed offsets equal layout offsets."""
    weights = [(f"w{i}", random_tensor((3,), torch.float32, rng)) for i in range(7)]
    bounded = list(split_weight_chunks_bounded((item for item in weights), 1 << 20, max_chunks=3))
    plain = list(split_weight_chunks((item for item in weights), 1 << 20))
    assert [(m.name, m.chunk_offset, m.chunk_size) for m, _ in bounded] == [
        (m.name, m.chunk_offset, m.chunk_size) for m, _ in plain
    ]
    assert [m.offset for m, _ in bounded] == [0, 12, 24, 0, 12, 24, 0]
    buckets = group_into_buckets(bounded)
    assert [len(b) for b in buckets] == [3, 3, 1]
    assert_same_weights(flatten(merge_all(buckets)), weights)
    with pytest.raises(ValueError, match="max_chunks must be an int >= 1"):
        split_weight_chunks_bounded((item for item in weights), 1 << 20, max_chunks=0)


def test_a_plan_closed_by_its_consumer_opens_the_next_bucket_at_offset_zero(rng: torch.Generator) -> None:
    """``BucketPlan.close_bucket`` between two chunks: the next chunk starts a bucket of its
    own, however much room the open one had; the chunks are the same."""
    weights = [(f"w{i}", random_tensor((3,), torch.float32, rng)) for i in range(4)]
    plan = BucketPlan(1 << 20, max_chunks=8)
    offsets = []
    for meta, _ in plan.chunks(item for item in weights):
        offsets.append(meta.offset)
        if meta.name == "w1":
            plan.close_bucket()
    assert offsets == [0, 12, 0, 12]
