"""``ckpt_core._internal.wire``: bucket headers round trip, and every malformed header is a
``WireFormatError`` (headers come from peers and are untrusted)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ckpt_core import TensorMeta, split_weight_chunks
from ckpt_core._internal.wire import FORMAT_VERSION, MAX_HEADER_BYTES, BucketHeader, decode_header, encode_header
from ckpt_core.errors import WireFormatError
from ckpt_core.tensors import transferable_dtypes
from tests.helpers.headers import header_bytes_of, header_fields
from tests.helpers.tensors import group_into_buckets, random_tensor

BUCKET = 256


def sample_header(rng: torch.Generator) -> BucketHeader:
    """The first bucket of a split of mixed tensors, as the pipeline would describe it."""
    weights = [(f"w.{i}", random_tensor((3,), d, rng)) for i, d in enumerate(transferable_dtypes())]
    weights.insert(1, ("empty", torch.empty(0, 2)))
    weights.insert(2, ("scalar", torch.tensor(1.5, dtype=torch.float64)))
    bucket = group_into_buckets(split_weight_chunks((item for item in weights), BUCKET))[0]
    metas = tuple(m for m, _ in bucket)
    end = max(m.offset + m.chunk_size for m in metas)  # type: ignore[operator]
    return BucketHeader(3, 7, end, False, metas, checksum=2**64 - 1)


def doc_of(header: BucketHeader) -> dict[str, Any]:
    return header_fields(encode_header(header))


def encode_doc(doc: Any) -> bytes:
    return header_bytes_of(doc)


# --- round trips -----------------------------------------------------------------------------


def test_round_trip(rng: torch.Generator) -> None:
    header = sample_header(rng)
    assert len(header.chunks) > 10
    assert decode_header(encode_header(header), bucket_size=BUCKET) == header


@pytest.mark.parametrize(
    "header",
    [
        BucketHeader(0, 0, 0, True),  # the empty refit: one empty last bucket
        BucketHeader(5, 2, 0, True, abort="RuntimeError: generator failed\nwith ünïcode"),
        BucketHeader(1, 1, 8, True, (TensorMeta("a", torch.Size([2]), torch.float32, 0, 8, 0),), checksum=None),
        BucketHeader(
            1, 1, BUCKET, False, (TensorMeta("big", torch.Size([1000]), torch.uint8, 256, 256, 0),), checksum=0
        ),
        BucketHeader(
            1,
            1,
            4,
            False,
            (
                TensorMeta("small", torch.Size([1]), torch.int32, 0, 4, 0),
                TensorMeta("big", torch.Size([BUCKET]), torch.uint8, 0, BUCKET, None),
            ),
        ),
    ],
    ids=["empty-last", "abort", "no-checksum", "full-bucket", "direct-chunk"],
)
def test_round_trip_edge_headers(header: BucketHeader) -> None:
    assert decode_header(encode_header(header), bucket_size=BUCKET) == header


def test_decode_accepts_bytearray_and_memoryview(rng: torch.Generator) -> None:
    header = sample_header(rng)
    raw = encode_header(header)
    assert decode_header(bytearray(raw), bucket_size=BUCKET) == header
    assert decode_header(memoryview(raw), bucket_size=BUCKET) == header


def test_encoding_is_versioned_ascii_json_an_envelope_then_the_chunk_list(rng: torch.Generator) -> None:
    raw = encode_header(sample_header(rng))
    raw.decode("ascii")
    envelope, chunks = (json.loads(part) for part in raw.split(b"\n"))
    assert envelope["format"] == FORMAT_VERSION and envelope["bucket"] == 7
    assert isinstance(chunks["names"], list) and isinstance(chunks["dtypes"][0], str)


# --- rejections ------------------------------------------------------------------------------


def _mutated(change: Any) -> Any:
    """A builder of bad header bytes: ``change`` edits a good header's JSON document in place."""

    def build(header: BucketHeader) -> bytes:
        doc = doc_of(header)
        change(doc)  # in place
        return encode_doc(doc)

    return build


def _set(key: str, value: Any) -> Any:
    return _mutated(lambda d: d.__setitem__(key, value))


def _set_column(column: str, index: int, value: Any) -> Any:
    return _mutated(lambda d: d[column].__setitem__(index, value))


REJECTED: dict[str, Any] = {
    "format 2": _set("format", FORMAT_VERSION + 1),
    "format 0": _set("format", 0),
    "format as string": _set("format", str(FORMAT_VERSION)),
    "format missing": _mutated(lambda d: d.pop("format")),
    "extra field": _set("compression", "zstd"),
    "missing field": _mutated(lambda d: d.pop("checksum")),
    "not json": lambda h: b"this is not json",
    "not utf-8": lambda h: b"\xff\xfe\x00{",
    "empty": lambda h: b"",
    "json array": lambda h: b"[1, 2, 3]",
    "json number": lambda h: b"1",
    "json null": lambda h: b"null",
    "refit string": _set("refit", "3"),
    "refit negative": _set("refit", -1),
    "bucket float": _set("bucket", 7.0),
    "bucket bool": _set("bucket", True),
    "nbytes negative": _set("nbytes", -8),
    "nbytes none": _set("nbytes", None),
    "payload larger than the bucket": _set("nbytes", BUCKET + 1),
    "last int": _set("last", 0),
    "last string": _set("last", "false"),
    "checksum negative": _set("checksum", -5),
    "checksum string": _set("checksum", "0xdead"),
    "checksum bool": _set("checksum", True),
    "checksum float": _set("checksum", 1.0),
    "abort int": _set("abort", 1),
    "names not a list": _set("names", "w.0"),
    "columns of different lengths": _mutated(lambda d: d["offsets"].pop()),
    "name int": _set_column("names", 0, 17),
    "shape not a list": _set_column("shapes", 0, 3),
    "shape negative": _set_column("shapes", 0, [-3]),
    "shape bool": _set_column("shapes", 0, [True]),
    "dtype unknown": _set_column("dtypes", 0, "float7"),
    "dtype int": _set_column("dtypes", 0, 7),
    "chunk_offset negative": _set_column("chunk_offsets", 0, -1),
    "chunk_size float": _set_column("chunk_sizes", 0, 4.0),
    "direct chunk of no bytes": _set_column("offsets", 1, None),  # chunk 1 is the empty tensor
    "direct chunks past the bucket size": _mutated(
        lambda d: [
            d[column].__setitem__(0, value)
            for column, value in [
                ("shapes", [BUCKET + 1]),
                ("dtypes", "uint8"),
                ("chunk_sizes", BUCKET + 1),
                ("offsets", None),
            ]
        ]
    ),
    "offset bool": _set_column("offsets", 0, False),
    "chunk outside its tensor": _set_column("chunk_sizes", 0, 10_000),
    "chunk outside the payload": _set_column("offsets", 0, BUCKET),
    "chunk ends past the payload": _mutated(lambda d: d.__setitem__("nbytes", d["nbytes"] - 1)),
}


@pytest.mark.parametrize("case", list(REJECTED), ids=list(REJECTED))
def test_decode_rejects(case: str, rng: torch.Generator) -> None:
    raw = REJECTED[case](sample_header(rng))
    with pytest.raises(WireFormatError):
        decode_header(raw, bucket_size=BUCKET)


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.25, 0.5, 0.9, 0.999])
def test_decode_rejects_truncated_headers(fraction: float, rng: torch.Generator) -> None:
    raw = encode_header(sample_header(rng))
    cut = int(len(raw) * fraction)
    with pytest.raises(WireFormatError, match="truncated or corrupt"):
        decode_header(raw[:cut], bucket_size=BUCKET)
    with pytest.raises(WireFormatError):
        decode_header(raw[: len(raw) - 1], bucket_size=BUCKET)


def test_decode_rejects_oversized_headers_unread() -> None:
    with pytest.raises(WireFormatError, match="exceeds"):
        decode_header(b" " * (MAX_HEADER_BYTES + 1), bucket_size=BUCKET)


def test_decode_rejects_deeply_nested_json() -> None:
    with pytest.raises(WireFormatError):
        decode_header(b"[" * 100_000 + b"]" * 100_000, bucket_size=BUCKET)


def test_error_messages_name_the_problem(rng: torch.Generator) -> None:
    header = sample_header(rng)
    with pytest.raises(WireFormatError, match=f"format version {FORMAT_VERSION + 1}.*same ckpt-core"):
        decode_header(REJECTED["format 2"](header), bucket_size=BUCKET)
    with pytest.raises(WireFormatError, match=f"{BUCKET + 1} bytes exceeds the bucket size {BUCKET}"):
        decode_header(REJECTED["payload larger than the bucket"](header), bucket_size=BUCKET)
    with pytest.raises(WireFormatError, match=f"'w.0'.*outside the {header.payload_nbytes}-byte payload"):
        decode_header(REJECTED["chunk outside the payload"](header), bucket_size=BUCKET)


def test_decode_rejects_quantized_dtypes(rng: torch.Generator) -> None:
    doc = doc_of(sample_header(rng))
    doc["dtypes"][0], doc["shapes"][0] = "qint8", [doc["chunk_sizes"][0]]  # 1-byte elements
    raw = encode_doc(doc)
    decode_header(raw.replace(b'"qint8"', b'"int8"'), bucket_size=BUCKET)  # valid but for the dtype
    with pytest.raises(WireFormatError, match="qint8"):
        decode_header(raw, bucket_size=BUCKET)


@pytest.mark.parametrize("shape", [[2**64], [2**40, 2**40]], ids=str)
def test_decode_rejects_shapes_too_large_for_torch(shape: list[int], rng: torch.Generator) -> None:
    doc = doc_of(sample_header(rng))
    doc["shapes"][0], doc["chunk_offsets"][0], doc["chunk_sizes"][0] = shape, 0, 0
    with pytest.raises(WireFormatError):
        decode_header(encode_doc(doc), bucket_size=BUCKET)


@pytest.mark.parametrize("dim", [1.0, True, "1", [1], None, -1], ids=repr)
def test_a_bad_shape_after_an_equal_good_one_is_rejected(dim: Any) -> None:
    """The decoder checks each distinct (dtype, shape) once; 1.0 and True compare equal to 1,
    so a shape repeated with them must not pass as the checked one."""
    metas = tuple(TensorMeta(f"w{i}", torch.Size([1]), torch.float32, 0, 4, 4 * i) for i in range(3))
    doc = doc_of(BucketHeader(0, 0, 12, True, metas))
    decode_header(encode_doc(doc), bucket_size=BUCKET)
    doc["shapes"][2] = [dim]
    with pytest.raises(WireFormatError, match="'w2': shape must be a list of ints"):
        decode_header(encode_doc(doc), bucket_size=BUCKET)
