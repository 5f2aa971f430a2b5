"""A bucket header's fields as one mapping to edit, and back to header bytes (its envelope and
chunk list are two JSON objects on the wire: see :mod:`ckpt_core._internal.wire`)."""

from __future__ import annotations

import json
from typing import Any

CHUNK_COLUMNS = frozenset({"names", "shapes", "dtypes", "chunk_offsets", "chunk_sizes", "offsets"})


def header_fields(raw: bytes) -> dict[str, Any]:
    """Every field of an encoded header, envelope and chunk list together."""
    envelope, chunks = raw.split(b"\n")
    return {**json.loads(envelope), **json.loads(chunks)}


def header_bytes_of(fields: dict[str, Any]) -> bytes:
    """``fields`` encoded as a header again: the chunk columns in the chunk list, every other
    field (an unknown one included) in the envelope."""
    envelope = {key: value for key, value in fields.items() if key not in CHUNK_COLUMNS}
    chunks = {key: value for key, value in fields.items() if key in CHUNK_COLUMNS}
    return json.dumps(envelope).encode() + b"\n" + json.dumps(chunks).encode()
