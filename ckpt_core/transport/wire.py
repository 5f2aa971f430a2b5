"""Advanced: the wire format's names, for a transport that reads bytes before the pipeline does.

Most transports never need these: the shared pipeline encodes, decodes and checks every header.
A transport that frames headers itself (cuda_ipc sizes its control messages by
``MAX_HEADER_BYTES`` and decodes a header to learn a bucket's direct chunks) or that names
dtypes in its own messages imports them from here.
"""

from __future__ import annotations

from ckpt_core._internal.wire import FORMAT_VERSION, MAX_HEADER_BYTES, BucketHeader, decode_header
from ckpt_core.tensors import dtype_from_name, dtype_name

__all__ = ["FORMAT_VERSION", "MAX_HEADER_BYTES", "BucketHeader", "decode_header", "dtype_from_name", "dtype_name"]
