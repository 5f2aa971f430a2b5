"""The seed's chunking algorithms: ``split_weight_chunks`` and ``merge_weight_chunk_batches``.

Chunk layout
------------
``split_weight_chunks`` cuts a stream of weights into byte chunks and lays them out in a
sequence of buckets of ``bucket_size`` bytes each, the unit a transport moves at once:

* ``TensorMeta.offset`` is the chunk's byte offset inside its bucket. Offsets are aligned to the
  tensor's element size, so a receiver can view a whole-tensor chunk as its dtype in place.
  A chunk whose ``offset`` is below the end of the previous chunk opens a new bucket (its
  ``offset`` is then 0); every other chunk follows the previous one in the same bucket.
* ``TensorMeta.chunk_offset`` / ``chunk_size`` locate the chunk's bytes inside the tensor's
  own bytes (C order). A tensor that does not fit in the space left in a bucket continues in
  the next bucket; chunk boundaries fall on element boundaries whenever an element fits in a
  bucket.
* A zero-element tensor yields exactly one chunk of size 0.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Iterator
from typing import Any

import torch

from ckpt_core._internal.assembly import ChunkAssembler
from ckpt_core._internal.dtypes import check_transferable
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import UnsupportedTensorError
from ckpt_core.options import check_bucket_size

__all__ = [
    "BucketPlan",
    "merge_weight_chunk_batches",
    "split_weight_chunks",
    "split_weight_chunks_bounded",
    "tensor_bytes",
]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes in C order (copying only if non-contiguous)."""
    # Attribute checks first: each op call costs microseconds, and this runs once per tensor.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        # Some dtypes (int1..int7, uint1..uint7) have no copy kernel; an integer view of the
        # same element size has one, and copying it moves exactly the same bytes.
        same_size = _INT_OF_SIZE.get(tensor.dtype.itemsize)
        tensor = (tensor.view(same_size) if same_size is not None else tensor).contiguous()
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def split_weight_chunks(
    weights: Generator[tuple[str, torch.Tensor], None, None],
    bucket_size: int,
) -> Generator[tuple[TensorMeta, torch.Tensor], None, None]:
    """Cut ``weights`` into byte chunks laid out in buckets of ``bucket_size`` bytes.

    Yields ``(meta, chunk)`` where ``chunk`` is a 1-D ``uint8`` view of the tensor's bytes (no
    copy for a contiguous tensor) and ``meta`` places it, as described in the module docstring.
    Every tensor is yielded whole, in order: zero-element and 0-d tensors, non-contiguous
    tensors and every non-quantized dtype included.

    Raises ``EngineOptionError`` (a ``ValueError``) for a bucket size that is not an int >= 1,
    and ``UnsupportedTensorError`` for an item that
    is not a byte-movable tensor, or whose name is not a string.
    """
    return BucketPlan(bucket_size).chunks(weights)


def split_weight_chunks_bounded(
    weights: Iterator[tuple[str, torch.Tensor]],
    bucket_size: int,
    *,
    max_chunks: int,
    keep_whole: int = 0,
    open_bucket: tuple[int, int] = (0, 0),
) -> Generator[tuple[TensorMeta, torch.Tensor], None, None]:
    """``split_weight_chunks`` as the refit pipeline lays buckets out: a bucket also closes
    after ``max_chunks`` chunks (so a bucket of many small tensors is posted early), and a
    tensor of at most ``keep_whole`` bytes that does not fit in the room left opens a new
    bucket instead of being split over two (a receiver can then take it straight from one
    bucket). ``open_bucket``: ``(bytes laid out, chunks placed)`` of a bucket already open,
    which the first chunks continue (the pipeline's replay hands its open bucket over so).
    :class:`BucketPlan` is the same layout with buckets its consumer may close early."""
    return BucketPlan(bucket_size, max_chunks=max_chunks, keep_whole=keep_whole, open_bucket=open_bucket).chunks(
        weights
    )


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


async def merge_weight_chunk_batches(
    chunk_batches: AsyncGenerator[list[tuple[TensorMeta, torch.Tensor]], None],
    *,
    merge_device: torch.device | str | None = None,
) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
    """Reassemble chunk batches into whole ``(name, tensor)`` batches.

    Each input batch produces one output batch holding the tensors whose last chunk it carried,
    in stream order; an input batch that completes no tensor produces nothing. Output tensors
    own their memory (they never alias the input chunks, so a producer may reuse its buffers
    once the next batch is requested).

    ``merge_device`` has NeMo RL's meaning: tensors assembled from several chunks are built on
    it; a tensor that one chunk carries whole stays on that chunk's device (NeMo RL's NIXL
    engine passes ``"cpu"`` to keep large, multi-bucket tensors off the GPU). ``None``: every
    tensor on its chunks' device.

    Never yields a partly filled tensor: a chunk that disagrees with the tensor being
    assembled (name, shape or dtype), a gap, an overlap, chunks out of order, a chunk whose
    length differs from its ``chunk_size``, or a stream that ends mid-tensor raise
    ``ChunkStreamError`` naming the tensor and the byte offsets.
    """
    device = torch.device(merge_device) if merge_device is not None else None
    assembler = ChunkAssembler(device, split_only=True)
    async for batch in chunk_batches:
        done: list[tuple[str, torch.Tensor]] = []
        for meta, chunk in batch:
            tensor = assembler.plan(meta, chunk.device).fill(chunk)
            if tensor is not None:
                done.append((meta.name, tensor))
        if done:
            yield done
    assembler.finish()
