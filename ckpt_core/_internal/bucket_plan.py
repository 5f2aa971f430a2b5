"""Where each chunk of a weight falls in a sequence of buckets: the layout of
:func:`ckpt_core.chunking.split_weight_chunks` (its module docstring states the rules), held
here so that the refit pipeline can steer it (close a bucket early) without importing the
seed's chunking module, which builds on this package.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import torch

from ckpt_core.contract import TensorMeta
from ckpt_core.errors import UnsupportedTensorError
from ckpt_core.options import check_bucket_size
from ckpt_core.tensors import check_transferable, tensor_bytes


class BucketPlan:
    """The layout of :func:`split_weight_chunks_bounded`, which its consumer may steer: after
    :meth:`close_bucket`, the next chunk opens a new bucket (offset 0), whatever room the open
    one had left. The refit pipeline closes a bucket so when it posts it early."""

    def __init__(
        self,
        bucket_size: int,
        *,
        max_chunks: int | None = None,
        keep_whole: int = 0,
        open_bucket: tuple[int, int] = (0, 0),
    ) -> None:
        check_bucket_size(bucket_size, name="bucket_size")
        if max_chunks is not None:
            _require_positive_int("max_chunks", max_chunks)
        used, chunks = open_bucket
        if not (0 <= used <= bucket_size and 0 <= chunks <= (max_chunks or chunks)):
            raise ValueError(
                f"open_bucket {open_bucket!r} does not fit buckets of {bucket_size} bytes, {max_chunks} chunks"
            )
        self.bucket_size = bucket_size
        self.max_chunks = max_chunks  # None: no bound
        self.keep_whole = min(keep_whole, bucket_size)
        self.used = used  # end of the last chunk placed in the open bucket
        self.placed = chunks  # chunks placed in it

    def close_bucket(self) -> None:
        """The next chunk opens a new bucket."""
        self.used = self.placed = 0

    def chunks(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Generator[tuple[TensorMeta, torch.Tensor], None, None]:
        """``weights`` cut into ``(meta, chunk)`` pairs laid out in this plan's buckets."""
        bucket_size, max_chunks, keep_whole = self.bucket_size, self.max_chunks, self.keep_whole
        for item in weights:
            name, tensor = _unpack_item(item)
            data = tensor_bytes(tensor)
            total = data.numel()
            # Element alignment, unless a bucket cannot hold even one element.
            align = tensor.dtype.itemsize if tensor.dtype.itemsize <= bucket_size else 1
            done = 0
            if total <= keep_whole and -(-self.used // align) * align + total > bucket_size:
                self.close_bucket()  # kept whole: it opens a new bucket
            while True:
                if self.placed == max_chunks:
                    self.close_bucket()  # the next chunk opens a new bucket
                offset, take = _place(self.used, total - done, align, bucket_size)
                self.placed = 1 if offset < self.used else self.placed + 1
                chunk = data if take == total else data[done : done + take]
                self.used = offset + take
                yield TensorMeta(name, tensor.shape, tensor.dtype, done, take, offset), chunk
                done += take
                if done == total:
                    break


def _require_positive_int(name: str, value: Any, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{unit}, got {value!r}")


def _place(used: int, remaining: int, align: int, bucket_size: int) -> tuple[int, int]:
    """Bucket offset and length of the next chunk, given ``used`` bytes of the open bucket."""
    offset = -(-used // align) * align
    room = bucket_size - offset
    if remaining == 0 and room >= 0:
        return offset, 0
    if room >= align:
        return offset, min(remaining, room - room % align)
    return 0, min(remaining, bucket_size - bucket_size % align)  # open a new bucket


def _unpack_item(item: Any) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise UnsupportedTensorError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str):
        raise UnsupportedTensorError(f"weight names must be strings, got {type(name).__name__} {name!r}")
    return name, check_transferable(name, tensor)
