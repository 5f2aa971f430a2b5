"""The bucket header: what a receiver must know to unpack one bucket, as versioned JSON.

A header is two compact JSON objects joined by a newline (compact JSON never contains one):

* the envelope: format version, refit and bucket index, payload size, ``last``, ``paced``,
  checksum and ``abort``, which change from refit to refit;
* the chunk list, column by column (names, shapes, dtypes, chunk offsets and sizes, offsets in
  the packed payload, ``null`` for a direct chunk), which keeps encoding and decoding cheap for
  buckets of many tiny tensors, and which repeats from one refit to the next: a receiver with a
  :class:`HeaderMemo` compares it byte for byte with the list it decoded for that bucket last
  time, and reuses that decoding instead of parsing and checking it again.

Decoding treats the bytes as untrusted: every field is type- and range-checked, and every chunk
must lie inside the payload, before anything is built from it. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable
from typing import Any

import torch

from ckpt_core.contract import TensorMeta, checked_meta, tensor_geometry
from ckpt_core.errors import WireFormatError
from ckpt_core.tensors import dtype_name

FORMAT_VERSION = 5
"""Raised whenever a byte layout between peers changes (this header, or a transport's framing:
3 added the distributed transports' fixed-size header frames, 4 split the header into an
envelope and a chunk list, 5 added ``paced``). Peers check it at init."""
MAX_HEADER_BYTES = 64 << 20
"""Upper bound on an encoded header (about 500k chunks); a larger length is refused unread."""

_COLUMNS = ("names", "shapes", "dtypes", "chunk_offsets", "chunk_sizes", "offsets")
_ENVELOPE = ("format", "refit", "bucket", "nbytes", "last", "paced", "checksum", "abort")


@dataclasses.dataclass(frozen=True)
class BucketHeader:
    """Describes bucket ``bucket_index`` of refit ``refit_index``.

    ``payload_nbytes`` bytes of the bucket buffer carry packed data; a chunk's ``offset``
    places it inside them, or is ``None`` for a direct chunk, which travels as a message of its
    own after the packed payload (see :mod:`ckpt_core._internal.bucket_io`). ``last`` marks the
    refit's final bucket. ``paced``: the sender posted it early because its weights come
    slowly, so the next bucket is a while away (the receiver finishes this one at once instead
    of overlapping it with the next one's transfer). ``checksum`` is the digest of the packed
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
    paced: bool = False


def encode_header(header: BucketHeader, *, encoded_chunks: bytes | None = None) -> bytes:
    """The header's bytes. ``encoded_chunks``: its chunk list as :func:`encode_chunks` encoded
    it before (a sender repeating a bucket reuses it)."""
    envelope = {
        "format": FORMAT_VERSION,
        "refit": header.refit_index,
        "bucket": header.bucket_index,
        "nbytes": header.payload_nbytes,
        "last": header.last,
        "paced": header.paced,
        "checksum": header.checksum,
        "abort": header.abort,
    }
    chunks = encoded_chunks if encoded_chunks is not None else encode_chunks(header.chunks)
    return _dumps(envelope) + b"\n" + chunks


def encode_chunks(chunks: Iterable[TensorMeta]) -> bytes:
    """A chunk list's part of a header."""
    chunks = tuple(chunks)
    return _dumps(
        {
            "names": [m.name for m in chunks],
            "shapes": [list(m.shape) for m in chunks],
            "dtypes": [dtype_name(m.dtype) for m in chunks],
            "chunk_offsets": [m.chunk_offset for m in chunks],
            "chunk_sizes": [m.chunk_size for m in chunks],
            "offsets": [m.offset for m in chunks],
        }
    )


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class HeaderMemo:
    """One receiver's decoded chunk lists, by bucket index, each with the bytes it came from.

    Refits of one run repeat their buckets' chunk lists; a header whose chunk list is byte for
    byte the one decoded for the same bucket before reuses that decoding (the same ``chunks``
    tuple): its chunks are not parsed, built or checked again. Their bounds against this
    header's payload size are checked again.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[bytes, int, tuple[TensorMeta, ...], int]] = {}

    def lookup(
        self, bucket_index: int, raw: bytes, bucket_size: int, payload_nbytes: int
    ) -> tuple[TensorMeta, ...] | None:
        entry = self._buckets.get(bucket_index)
        if entry is None or entry[1] != bucket_size or entry[0] != raw:
            return None
        chunks, packed_end = entry[2], entry[3]
        if packed_end > payload_nbytes:
            return None  # decoded again, which names the chunk outside the payload
        return chunks

    def store(self, bucket_index: int, raw: bytes, bucket_size: int, chunks: tuple[TensorMeta, ...]) -> None:
        ends = [m.offset + m.chunk_size for m in chunks if m.offset is not None]
        self._buckets[bucket_index] = (raw, bucket_size, chunks, max(ends, default=0))

    def clear(self) -> None:
        self._buckets.clear()


def decode_header(
    data: bytes | bytearray | memoryview, *, bucket_size: int, memo: HeaderMemo | None = None
) -> BucketHeader:
    """Parse and validate a header; raises ``WireFormatError`` for anything malformed.
    ``memo``: reuse (and keep) the checked chunk lists of earlier headers."""
    if len(data) > MAX_HEADER_BYTES:
        raise WireFormatError(f"bucket header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    raw = bytes(data)
    split = raw.find(b"\n")
    if split < 0:
        raise WireFormatError("bucket header has no chunk list after its envelope; truncated or corrupt")
    doc = _object(raw[:split], "bucket header")
    version = doc.get("format")
    if version != FORMAT_VERSION:
        raise WireFormatError(
            f"bucket header has format version {version!r}, this side speaks {FORMAT_VERSION}: "
            "install the same ckpt-core version on senders and receivers"
        )
    if set(doc) != set(_ENVELOPE):
        raise WireFormatError(f"bucket header fields {sorted(doc)} differ from {sorted(_ENVELOPE)}")
    refit = _uint(doc, "refit")
    bucket = _uint(doc, "bucket")
    nbytes = _uint(doc, "nbytes")
    if nbytes > bucket_size:
        raise WireFormatError(f"bucket payload of {nbytes} bytes exceeds the bucket size {bucket_size}")
    last = doc["last"]
    if not isinstance(last, bool):
        raise WireFormatError(f"bucket header 'last' must be a bool, got {last!r}")
    paced = doc["paced"]
    if not isinstance(paced, bool):
        raise WireFormatError(f"bucket header 'paced' must be a bool, got {paced!r}")
    checksum = doc["checksum"]
    if checksum is not None and not _is_uint(checksum):
        raise WireFormatError(f"bucket header 'checksum' must be an int >= 0 or null, got {checksum!r}")
    abort = doc["abort"]
    if abort is not None and not isinstance(abort, str):
        raise WireFormatError(f"bucket header 'abort' must be a string or null, got {abort!r}")
    encoded = raw[split + 1 :]
    chunks = memo.lookup(bucket, encoded, bucket_size, nbytes) if memo is not None else None
    if chunks is None:
        columns = _object(encoded, "bucket header chunk list")
        if set(columns) != set(_COLUMNS):
            raise WireFormatError(f"bucket header chunk list fields {sorted(columns)} differ from {sorted(_COLUMNS)}")
        chunks = _decode_chunks(columns, nbytes, bucket_size)
        if memo is not None:
            memo.store(bucket, encoded, bucket_size, chunks)
    return BucketHeader(refit, bucket, nbytes, last, chunks, checksum, abort, paced)


def _object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireFormatError(f"{what} is not valid JSON ({exc}); truncated or corrupt") from None
    if not isinstance(doc, dict):
        raise WireFormatError(f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc


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
