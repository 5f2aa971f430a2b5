"""The refit contract: ``TensorMeta`` and ``CheckpointEngine``, as NeMo RL names them.

Names, fields, keyword-only arguments and sync/async kinds follow NeMo RL's
``nemo_rl.utils.checkpoint_engines.base`` exactly, so an engine written for one runs on the other.
The chunking algorithms are in :mod:`ckpt_core.chunking`, backend resolution in
:mod:`ckpt_core.registry`; :mod:`ckpt_core.base` gathers all five names under NeMo RL's path.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import math
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

from ckpt_core.errors import LayoutUnavailableError, LifecycleError, WireFormatError
from ckpt_core.options import check_bool
from ckpt_core.tensors import dtype_from_name, dtype_name

__all__ = ["MAX_TENSOR_BYTES", "CheckpointEngine", "TensorMeta", "checked_meta", "tensor_geometry"]


@dataclasses.dataclass
class TensorMeta:
    """Where one chunk of one named tensor sits, in the tensor and in its bucket.

    ``nbytes`` is the size of the whole tensor (``numel * itemsize``), not of the chunk.

    A plain mutable dataclass, as in NeMo RL: an engine that lays out buckets of its own
    assigns ``meta.offset`` to the metas ``split_weight_chunks`` yields (NeMo RL's NIXL engine
    does). Being mutable it is not hashable; the library never keys anything on one.
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
        """Inverse of :meth:`to_dict`. Validates every field (types, signs, the tensor's size of
        at most ``MAX_TENSOR_BYTES``, the chunk's bounds) before building; ``WireFormatError``."""
        if not isinstance(data, dict):
            raise WireFormatError(f"tensor metadata must be a mapping, got {type(data).__name__}")
        expected = {"name", "shape", "dtype", "chunk_offset", "chunk_size", "offset"}
        if set(data) != expected:
            raise WireFormatError(f"tensor metadata keys {sorted(data)} differ from the expected {sorted(expected)}")
        name = data["name"]
        shape, dtype, nbytes = tensor_geometry(name, data["shape"], data["dtype"])
        return checked_meta(name, shape, dtype, nbytes, data["chunk_offset"], data["chunk_size"], data["offset"])


def checked_meta(
    name: Any, shape: torch.Size, dtype: torch.dtype, nbytes: int, chunk_offset: Any, chunk_size: Any, offset: Any
) -> TensorMeta:
    """A ``TensorMeta`` from untrusted chunk fields of a tensor whose ``shape``, ``dtype`` and
    ``nbytes`` came from :func:`tensor_geometry` (a decoder checks each distinct shape once).
    Types, signs and the chunk's bounds inside the tensor are checked; ``WireFormatError``
    otherwise."""
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
    return TensorMeta(name, shape, dtype, chunk_offset, chunk_size, offset)


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
        """Return the destination-local layout for this policy rank, if any.

        An engine with ``shard_expert_weights`` set must provide the layout; this default then
        raises ``LayoutUnavailableError`` (a ``NotImplementedError``), as NeMo RL's base does.
        """
        if self.shard_expert_weights:
            raise LayoutUnavailableError(
                f"{type(self).__name__} must implement get_target_weight_layout() when shard_expert_weights is enabled."
            )
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

    # -- for callers that block (not in NeMo RL's base) ----------------------------------------
    def send_weights_blocking(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """``send_weights`` for a caller that blocks (a synchronous worker method, a script):
        returns once the refit is sent. This default runs the coroutine on an event loop of its
        own; an engine may run the refit on the calling thread instead, as ``BucketedEngine``
        does. ``LifecycleError`` on a thread whose event loop is running: await
        ``send_weights`` there."""
        refuse_running_loop("send_weights_blocking()", "await send_weights()")
        asyncio.run(self.send_weights(weights))

    def receive_weight_batches_blocking(
        self, *, owned: bool = False
    ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """``receive_weight_batches`` for a caller that blocks: the same batches as a plain
        generator, which waits for each. ``owned``: every tensor owns its memory, even where
        the engine would lend its buffers (keep them past the next batch); this default clones
        each tensor then, as it cannot tell which are lent. This default steps the async
        generator on an event loop of its own; an engine may step the refit on the calling
        thread instead, as ``BucketedEngine`` does. Closing it early stops the refit early, as
        ``aclose()`` does. ``LifecycleError`` on a thread whose event loop is running: iterate
        ``receive_weight_batches`` there."""
        refuse_running_loop("receive_weight_batches_blocking()", "async for over receive_weight_batches()")
        check_bool("receive_weight_batches_blocking()", "owned", owned)
        batches = self.receive_weight_batches()
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    batch = loop.run_until_complete(batches.__anext__())
                except StopAsyncIteration:
                    return
                yield [(name, tensor.clone()) for name, tensor in batch] if owned else batch
        finally:
            loop.run_until_complete(batches.aclose())
            loop.close()


def refuse_running_loop(call: str, instead: str) -> None:
    """``LifecycleError`` if this thread runs an event loop, which ``call`` would block."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise LifecycleError(f"{call} blocks, and this thread runs an event loop: use {instead} on it instead")
