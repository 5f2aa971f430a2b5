"""A payload checksum computed where the payload lives (GPU or host), for device buffers.

:func:`ckpt_core._internal.checksum.payload_checksum` (xxh3) reads host memory, so a transport whose
bucket buffers live on a GPU would have to copy every bucket to the host to use it. This
checksum runs as a few ``torch`` reductions on the buffer's own device and moves only six
integers to the host.

Algorithm ("pwsum64", position-weighted sums modulo 2**64): the payload's leading bytes are
read as little-endian int64 words laid out in rows of :data:`ROW_WORDS` words. From the row
sums ``r_i`` and column sums ``c_j`` it takes ``S = sum(r_i)``, ``R = sum((i + 1) * r_i)``
and ``C = sum((j + 1) * c_j)``; the words past the last full row and the last ``n % 8``
bytes get their own plain and position-weighted sums. The digest is xxh3_64 of the byte
count and those sums. Integer sums wrap modulo 2**64 on every device torch supports and do
not depend on reduction order, so the digest is deterministic and the same on CPU and GPU.

What it catches: any change to a single word (``S`` changes), two unequal words swapped or
a region shifted (the weighted sums change unless the difference is a multiple of a large
power of two), a zeroed or stale region, a wrong length. It is an integrity check against
bugs and faults, not a cryptographic hash.

Cost: two reads of the payload on the device (row sums and column sums), a handful of tiny
kernels and one device-to-host copy of six integers, which waits for the reductions.
"""

from __future__ import annotations

import struct

import torch
import xxhash

ALGORITHM = "pwsum64"
ROW_WORDS = 4096
"""int64 words per row of the 2-D view the sums are taken over."""


def device_payload_checksum(payload: torch.Tensor) -> int:
    """A 64-bit digest of a 1-D ``uint8`` tensor's bytes, computed on the tensor's device.

    Reads the tensor in place (an unaligned view is copied once). Work is queued on the
    device's current stream; the call returns when the digest is known.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(
            f"device_payload_checksum takes a 1-D uint8 tensor, got {payload.dtype} of shape {list(payload.shape)}"
        )
    nbytes = payload.numel()
    if not payload.is_contiguous() or payload.storage_offset() % 8:
        payload = payload.clone()  # a fresh allocation is contiguous and word-aligned
    body = nbytes - nbytes % 8
    words = payload[:body].view(torch.int64)
    rows = words.numel() // ROW_WORDS
    full = words[: rows * ROW_WORDS].view(rows, ROW_WORDS)
    tail_words = words[rows * ROW_WORDS :]
    tail_bytes = payload[body:].to(torch.int64)
    device = payload.device

    row_sums = full.sum(dim=1)
    col_sums = full.sum(dim=0)
    sums = torch.stack(
        [
            row_sums.sum() + tail_words.sum() + tail_bytes.sum(),
            (row_sums * _weights(rows, device)).sum(),
            (col_sums * _weights(ROW_WORDS, device)).sum(),
            (tail_words * _weights(tail_words.numel(), device)).sum(),
            (tail_bytes * _weights(tail_bytes.numel(), device)).sum(),
        ]
    )
    values = sums.tolist()  # the one device-to-host copy; waits for the reductions
    return xxhash.xxh3_64_intdigest(struct.pack("<6q", nbytes, *values))


def _weights(count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, count + 1, dtype=torch.int64, device=device)
