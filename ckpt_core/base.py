"""The refit contract: ``TensorMeta``, ``CheckpointEngine`` and the chunking algorithms.

Names, fields, keyword-only arguments and sync/async kinds follow NeMo RL's
``nemo_rl.utils.checkpoint_engines.base`` exactly, so an engine written for one runs on the other.

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

import abc
import dataclasses
import math
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

from .dtypes import check_transferable, dtype_from_name, dtype_name
from .errors import UnsupportedTensorError, WireFormatError

__all__ = [
    "CheckpointEngine",
    "TensorMeta",
    "create_checkpoint_engine",
    "merge_weight_chunk_batches",
    "split_weight_chunks",
]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Where one chunk of one named tensor sits, in the tensor and in its bucket.

    ``nbytes`` is the size of the whole tensor (``numel * itemsize``), not of the chunk.
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    chunk_offset: int
    chunk_size: int
    offset: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible data: dtype as its name, shape as a list of ints."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "chunk_offset": self.chunk_offset,
            "chunk_size": self.chunk_size,
            "offset": self.offset,
        }

    @classmethod
    def from_dict(cls, data: Any) -> TensorMeta:
        """Inverse of :meth:`to_dict`. Validates every field; raises ``WireFormatError``."""
        if not isinstance(data, dict):
            raise WireFormatError(f"tensor metadata must be a mapping, got {type(data).__name__}")
        expected = {"name", "shape", "dtype", "chunk_offset", "chunk_size", "offset"}
        if set(data) != expected:
            raise WireFormatError(
                f"tensor metadata keys {sorted(data)} differ from the expected {sorted(expected)}"
            )
        return cls.validated(
            data["name"], data["shape"], data["dtype"], data["chunk_offset"], data["chunk_size"], data["offset"]
        )

    @classmethod
    def validated(
        cls, name: Any, shape: Any, dtype: Any, chunk_offset: Any, chunk_size: Any, offset: Any
    ) -> TensorMeta:
        """Build a ``TensorMeta`` from untrusted plain values (dtype as its name).

        Types, signs, the tensor's size (at most ``MAX_TENSOR_BYTES``) and the chunk's bounds
        inside the tensor are checked before anything is built; ``WireFormatError`` otherwise.
        """
        size, torch_dtype, nbytes = tensor_geometry(name, shape, dtype)
        return cls.checked_chunk(name, size, torch_dtype, nbytes, chunk_offset, chunk_size, offset)

    @classmethod
    def checked_chunk(
        cls, name: Any, shape: torch.Size, dtype: torch.dtype, nbytes: int, chunk_offset: Any, chunk_size: Any, offset: Any
    ) -> TensorMeta:
        """The chunk half of :meth:`validated`, for a tensor whose ``shape``, ``dtype`` and
        ``nbytes`` came from :func:`tensor_geometry` (a decoder checks each distinct shape once)."""
        if type(name) is not str:
            raise WireFormatError(f"tensor name must be a string, got {type(name).__name__}")
        # type(...) is int: exact ints only (bool is a subclass of int, and refused)
        if type(chunk_offset) is not int or chunk_offset < 0:
            raise WireFormatError(f"tensor {name!r}: chunk_offset must be an int >= 0, got {chunk_offset!r}")
        if type(chunk_size) is not int or chunk_size < 0:
            raise WireFormatError(f"tensor {name!r}: chunk_size must be an int >= 0, got {chunk_size!r}")
        if offset is not None and (type(offset) is not int or offset < 0):
            raise WireFormatError(f"tensor {name!r}: offset must be an int >= 0 or None, got {offset!r}")
        if chunk_offset + chunk_size > nbytes:
            raise WireFormatError(
                f"tensor {name!r}: chunk [{chunk_offset}, {chunk_offset + chunk_size}) lies outside "
                f"the tensor's {nbytes} bytes"
            )
        return cls.trusted(name, shape, dtype, chunk_offset, chunk_size, offset)

    @classmethod
    def trusted(
        cls, name: str, shape: torch.Size, dtype: torch.dtype, chunk_offset: int, chunk_size: int, offset: int | None
    ) -> TensorMeta:
        """``TensorMeta(...)`` for values already checked, three times faster: it sets the
        fields at once instead of through the frozen dataclass's ``__setattr__`` one by one.
        The chunking and the wire decoder build one per chunk."""
        meta = _new_object(cls)
        _set_attribute(meta, "__dict__", {
            "name": name, "shape": shape, "dtype": dtype,
            "chunk_offset": chunk_offset, "chunk_size": chunk_size, "offset": offset,
        })
        return meta


_new_object = object.__new__
_set_attribute = object.__setattr__


def tensor_geometry(name: Any, shape: Any, dtype: Any) -> tuple[torch.Size, torch.dtype, int]:
    """Check an untrusted shape (a list of ints >= 0) and dtype name; returns the shape as a
    ``torch.Size``, the dtype and the tensor's size in bytes (at most ``MAX_TENSOR_BYTES``).
    ``WireFormatError`` otherwise; ``name`` is only used in its message."""
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise WireFormatError(f"tensor {name!r}: shape must be a list of ints >= 0, got {shape!r}")
    torch_dtype = dtype_from_name(dtype)
    nbytes = math.prod(shape) * torch_dtype.itemsize
    # An empty tensor's contiguous strides are products of its other dimensions: bound them too,
    # or building it overflows int64 (its size, 0, says nothing about them).
    span = nbytes if nbytes else math.prod(max(d, 1) for d in shape) * torch_dtype.itemsize
    if span > MAX_TENSOR_BYTES:
        raise WireFormatError(f"tensor {name!r}: shape {shape} spans {span} bytes, over {MAX_TENSOR_BYTES}")
    return torch.Size(shape), torch_dtype, nbytes


MAX_TENSOR_BYTES = 1 << 62
"""Largest tensor a peer may announce; anything larger cannot exist and is refused unread."""


class CheckpointEngine(abc.ABC):
    """A transport that moves weights from policy (training) to rollout (generation) workers.

    Lifecycle, driven by the caller's orchestrator on every worker:

    1. ``prepare()`` on every worker; the orchestrator gathers the returned metadata into one
       list, policy workers' entries first (by rank), then rollout workers' entries.
    2. ``init_policy_process_group`` on policy workers and ``init_rollout_process_group`` on
       rollout workers, each given that whole list.
    3. Any number of refits: ``send_weights`` on every policy worker, concurrently with
       iterating ``receive_weight_batches`` on every rollout worker.
    4. ``finalize()`` releases what 1 and 2 acquired; 1 may then start again.

    Engines are constructed with ``bucket_size`` (bytes) and their own keyword options.
    """

    shard_expert_weights: bool = False

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """Return the destination-local layout for this policy rank, if any."""
        return None

    @abc.abstractmethod
    def prepare(self) -> Any:
        """Allocate or register backend resources and return serializable metadata."""

    @abc.abstractmethod
    def init_policy_process_group(
        self,
        *,
        worker_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        """Connect a policy worker to its transfer peer."""

    @abc.abstractmethod
    def init_rollout_process_group(
        self,
        *,
        rollout_rank: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[Any],
    ) -> None:
        """Connect a rollout worker to its transfer peer."""

    def finalize(self) -> None:
        """Release per-refit backend state."""

    @abc.abstractmethod
    async def send_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
    ) -> None:
        """Send (name, tensor) weights from the policy side."""

    @abc.abstractmethod
    def receive_weight_batches(
        self,
    ) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Yield (name, tensor) batches on the generation side."""


def create_checkpoint_engine(
    backend: str,
    *,
    bucket_size_bytes: int,
    engine_kwargs: dict[str, Any],
) -> CheckpointEngine:
    """Build the engine registered as ``backend`` (or given as ``"module:ClassName"``).

    ``engine_kwargs`` are checked against the engine constructor's named parameters before it
    is called; the engine receives ``bucket_size_bytes`` as ``bucket_size``. See
    :mod:`ckpt_core.registry` for resolution and its errors.
    """
    from .registry import build_engine

    return build_engine(backend, bucket_size_bytes=bucket_size_bytes, engine_kwargs=engine_kwargs)


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

    Raises ``ValueError`` if ``bucket_size < 1`` and ``UnsupportedTensorError`` for an item that
    is not a byte-movable tensor, or whose name is not a string.
    """
    _require_positive_int("bucket_size", bucket_size, " (bytes)")
    return _split(weights, bucket_size, None)


def split_weight_chunks_bounded(
    weights: Generator[tuple[str, torch.Tensor], None, None], bucket_size: int, *, max_chunks: int
) -> Generator[tuple[TensorMeta, torch.Tensor], None, None]:
    """``split_weight_chunks``, also opening a new bucket after ``max_chunks`` chunks: the
    refit pipeline's layout, which posts a bucket of many small tensors early."""
    _require_positive_int("bucket_size", bucket_size, " (bytes)")
    _require_positive_int("max_chunks", max_chunks)
    return _split(weights, bucket_size, max_chunks)


def _require_positive_int(name: str, value: Any, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{unit}, got {value!r}")


def _split(
    weights: Generator[tuple[str, torch.Tensor], None, None], bucket_size: int, max_chunks: int | None
) -> Generator[tuple[TensorMeta, torch.Tensor], None, None]:
    used = 0  # end of the last chunk placed in the current bucket
    chunks = 0  # chunks placed in the current bucket
    for item in weights:
        name, tensor = _unpack_item(item)
        data = tensor_bytes(tensor)
        total = data.numel()
        # Element alignment, unless a bucket cannot hold even one element.
        align = tensor.dtype.itemsize if tensor.dtype.itemsize <= bucket_size else 1
        done = 0
        while True:
            if chunks == max_chunks:
                used = chunks = 0  # the next chunk opens a new bucket
            offset, take = _place(used, total - done, align, bucket_size)
            chunks = 1 if offset < used else chunks + 1
            chunk = data if take == total else data[done : done + take]
            yield TensorMeta.trusted(name, tensor.shape, tensor.dtype, done, take, offset), chunk
            used = offset + take
            done += take
            if done == total:
                break


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
        raise UnsupportedTensorError(
            f"weights must yield (name, tensor) pairs, got {type(item).__name__}"
        )
    name, tensor = item
    if not isinstance(name, str):
        raise UnsupportedTensorError(
            f"weight names must be strings, got {type(name).__name__} {name!r}"
        )
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
    once the next batch is requested) and live on ``merge_device``, or on the chunks' device
    when it is ``None``.

    Never yields a partly filled tensor: a chunk that disagrees with the tensor being
    assembled (name, shape or dtype), a gap, an overlap, chunks out of order, a chunk whose
    length differs from its ``chunk_size``, or a stream that ends mid-tensor raise
    ``ChunkStreamError`` naming the tensor and the byte offsets.
    """
    from .assembly import ChunkAssembler  # assembly builds on TensorMeta, defined above

    assembler = ChunkAssembler(torch.device(merge_device) if merge_device is not None else None)
    async for batch in chunk_batches:
        done: list[tuple[str, torch.Tensor]] = []
        for meta, chunk in batch:
            tensor = assembler.plan(meta, chunk.device).fill(chunk)
            if tensor is not None:
                done.append((meta.name, tensor))
        if done:
            yield done
    assembler.finish()
