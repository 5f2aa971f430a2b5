"""The bucket header: what a receiver must know to unpack one bucket, as versioned JSON.

A header lists the bucket's chunks column by column (names, shapes, dtypes, chunk offsets and
sizes, offsets in the packed payload, ``null`` for a direct chunk), which keeps encoding and
decoding cheap for buckets of many tiny tensors. Decoding treats the bytes as untrusted: every
field is type- and range-checked, and
every chunk must lie inside the payload, before anything is built from it. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable
from typing import Any

import torch

from ckpt_core._internal.dtypes import dtype_name
from ckpt_core.contract import TensorMeta, checked_meta, tensor_geometry
from ckpt_core.errors import WireFormatError

FORMAT_VERSION = 3
"""Raised whenever a byte layout between peers changes (this header, or a transport's framing:
3 added the distributed transports' fixed-size header frames). Peers check it at init."""
MAX_HEADER_BYTES = 64 << 20
"""Upper bound on an encoded header (about 500k chunks); a larger length is refused unread."""

_COLUMNS = ("names", "shapes", "dtypes", "chunk_offsets", "chunk_sizes", "offsets")
_FIELDS = {"format", "refit", "bucket", "nbytes", "last", "checksum", "abort", *_COLUMNS}


@dataclasses.dataclass(frozen=True)
class BucketHeader:
    """Describes bucket ``bucket_index`` of refit ``refit_index``.

    ``payload_nbytes`` bytes of the bucket buffer carry packed data; a chunk's ``offset``
    places it inside them, or is ``None`` for a direct chunk, which travels as a message of its
    own after the packed payload (see :mod:`ckpt_core.transport.interfaces`). ``last`` marks the
    refit's final bucket. ``checksum`` is the digest of the packed
    payload and the direct chunks (see ``ckpt_core._internal.pipeline.bucket_digest``), or ``None`` when
    the sender has checksums off. ``abort`` carries the sender's error message
    when it gave up on the refit; such a header has no chunks and no payload.
    """

    refit_index: int
    bucket_index: int
    payload_nbytes: int
    last: bool
    chunks: tuple[TensorMeta, ...] = ()
    checksum: int | None = None
    abort: str | None = None


def encode_header(header: BucketHeader) -> bytes:
    chunks = header.chunks
    doc = {
        "format": FORMAT_VERSION,
        "refit": header.refit_index,
        "bucket": header.bucket_index,
        "nbytes": header.payload_nbytes,
        "last": header.last,
        "checksum": header.checksum,
        "abort": header.abort,
        "names": [m.name for m in chunks],
        "shapes": [list(m.shape) for m in chunks],
        "dtypes": [dtype_name(m.dtype) for m in chunks],
        "chunk_offsets": [m.chunk_offset for m in chunks],
        "chunk_sizes": [m.chunk_size for m in chunks],
        "offsets": [m.offset for m in chunks],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def decode_header(data: bytes | bytearray | memoryview, *, bucket_size: int) -> BucketHeader:
    """Parse and validate a header; raises ``WireFormatError`` for anything malformed."""
    if len(data) > MAX_HEADER_BYTES:
        raise WireFormatError(f"bucket header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireFormatError(f"bucket header is not valid JSON ({exc}); truncated or corrupt") from None
    if not isinstance(doc, dict):
        raise WireFormatError(f"bucket header must be a JSON object, got {type(doc).__name__}")
    version = doc.get("format")
    if version != FORMAT_VERSION:
        raise WireFormatError(
            f"bucket header has format version {version!r}, this side speaks {FORMAT_VERSION}: "
            "install the same ckpt-core version on senders and receivers"
        )
    if set(doc) != _FIELDS:
        raise WireFormatError(f"bucket header fields {sorted(doc)} differ from {sorted(_FIELDS)}")
    refit = _uint(doc, "refit")
    bucket = _uint(doc, "bucket")
    nbytes = _uint(doc, "nbytes")
    if nbytes > bucket_size:
        raise WireFormatError(f"bucket payload of {nbytes} bytes exceeds the bucket size {bucket_size}")
    last = doc["last"]
    if not isinstance(last, bool):
        raise WireFormatError(f"bucket header 'last' must be a bool, got {last!r}")
    checksum = doc["checksum"]
    if checksum is not None and not _is_uint(checksum):
        raise WireFormatError(f"bucket header 'checksum' must be an int >= 0 or null, got {checksum!r}")
    abort = doc["abort"]
    if abort is not None and not isinstance(abort, str):
        raise WireFormatError(f"bucket header 'abort' must be a string or null, got {abort!r}")
    chunks = _decode_chunks(doc, nbytes, bucket_size)
    return BucketHeader(refit, bucket, nbytes, last, chunks, checksum, abort)


def _decode_chunks(doc: dict[str, Any], payload_nbytes: int, bucket_size: int) -> tuple[TensorMeta, ...]:
    columns = [doc[c] for c in _COLUMNS]
    if not all(isinstance(col, list) for col in columns):
        raise WireFormatError("bucket header chunk columns must be lists")
    count = len(columns[0])
    if any(len(col) != count for col in columns):
        raise WireFormatError("bucket header chunk columns have different lengths")
    # Each distinct (dtype, shape) is checked once: a bucket of many small tensors repeats a few.
    # Shapes made of exact ints only may key the cache (1.0 and True would equal 1 there).
    shapes = columns[1]
    cacheable = _only(shapes, list) and _only(itertools.chain.from_iterable(shapes), int)
    geometries: dict[tuple[Any, ...], tuple[torch.Size, torch.dtype, int]] = {}
    chunks = []
    direct_nbytes = 0
    for name, shape, dtype, chunk_offset, chunk_size, offset in zip(*columns):
        key = (dtype, *shape) if cacheable and type(dtype) is str else None
        geometry = geometries.get(key) if key is not None else None
        if geometry is None:
            geometry = tensor_geometry(name, shape, dtype)
            if key is not None:
                geometries[key] = geometry
        meta = checked_meta(name, *geometry, chunk_offset, chunk_size, offset)
        if offset is None:
            direct_nbytes += chunk_size
            if chunk_size == 0 or direct_nbytes > bucket_size:
                raise WireFormatError(
                    f"tensor {name!r}: direct chunk of {chunk_size} bytes brings the bucket's direct "
                    f"chunks to {direct_nbytes} bytes; they must be non-empty and at most the "
                    f"bucket size {bucket_size} together"
                )
        elif offset + chunk_size > payload_nbytes:
            raise WireFormatError(
                f"tensor {name!r}: chunk at bucket offset {offset!r} (size {chunk_size}) lies "
                f"outside the {payload_nbytes}-byte payload"
            )
        chunks.append(meta)
    return tuple(chunks)


def _only(values: Iterable[Any], kind: type) -> bool:
    """Whether every value's type is exactly ``kind`` (one C loop, no per-item Python)."""
    return set(map(type, values)) <= {kind}


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _uint(doc: dict[str, Any], field: str) -> int:
    value = doc[field]
    if not _is_uint(value):
        raise WireFormatError(f"bucket header {field!r} must be an int >= 0, got {value!r}")
    return int(value)
