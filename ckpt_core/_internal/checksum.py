"""Payload checksums: xxHash3 (64-bit) over a bucket's bytes.

xxh3 is several times faster than zlib's crc32: the fastest integrity check at hand, yet on a
host refit it competes with the transfer for the cores, which is why the host transports
default it off (measured in docs/reliability.md, "Integrity").
"""

from __future__ import annotations

import torch
import xxhash

ALGORITHM = "xxh3_64"


def payload_checksum(payload: torch.Tensor) -> int:
    """xxh3_64 of a 1-D ``uint8`` CPU tensor's bytes (read in place, no copy)."""
    if payload.device.type != "cpu":
        raise ValueError(
            f"payload_checksum reads host memory; got a tensor on {payload.device}: "
            "copy it to the host or disable checksums for device buffers"
        )
    if payload.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(payload.numpy().data)
