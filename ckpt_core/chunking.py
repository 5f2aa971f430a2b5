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

import torch

from ckpt_core._internal.assembly import ChunkAssembler
from ckpt_core._internal.bucket_plan import BucketPlan
from ckpt_core.contract import TensorMeta
from ckpt_core.tensors import tensor_bytes

__all__ = [
    "BucketPlan",
    "merge_weight_chunk_batches",
    "split_weight_chunks",
    "split_weight_chunks_bounded",
    "tensor_bytes",
]


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
