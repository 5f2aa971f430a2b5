"""The vLLM worker extension: each vLLM worker (each tensor-parallel rank) becomes one rollout
rank of a refit.

Give it to vLLM as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` or
``vllm serve --worker-extension-cls ckpt_vllm.extension.CkptEngineWorkerExtension``; vLLM adds
it to its worker class's bases, so its methods run inside every worker, reached from the
driver with ``collective_rpc("ckpt_engine_...", kwargs=...)``. Names start with ``ckpt_engine_``
so they cannot clash with vLLM's own (vLLM refuses an extension that shadows a worker
attribute).

Every method returns a reply record, never raises: ``{"ok": True, "result": ...}`` or
``{"ok": False, "error_type": ..., "message": ..., "traceback": ...}``, so the driver learns the
outcome of every rank, not only the first failure. :class:`ckpt_vllm.rollout.VllmRollout`
turns the records into values or one error naming every failed rank.

Lifecycle, per rank: ``create`` -> ``prepare`` -> ``init`` -> (``refit`` -> ``commit``)... ->
``finalize``; ``reset`` replaces a failed engine (then ``prepare`` and ``init`` again). A rank
is *current* only between a ``commit`` and the next ``refit``: ``refit`` marks it not current
first (its weights are about to change), and only the driver, once every rank loaded the
whole refit, commits the new version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Generator
from typing import Any

import torch

from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import LifecycleError
from ckpt_core.host_pool import limit_host_pool
from ckpt_core.layout import WeightLayout
from ckpt_core.options import schema_of
from ckpt_core.orchestration.protocol import error_reply
from ckpt_core.orchestration.workload import tensor_digest
from ckpt_core.registry import create_checkpoint_engine, resolve_backend
from ckpt_vllm.layout import checkpoint_parameter_bytes, derive_weight_layout, full_weight
from ckpt_vllm.loading import load_streamed_weights, own_pending_weights
from ckpt_vllm.rss import (
    GROWTH_ALLOWANCE_BYTES,
    HeapGuard,
    peak_rss_bytes,
    release_free_heap,
    reset_peak_rss,
    rss_bytes,
)


@dataclasses.dataclass
class _RankState:
    """What one worker knows of its refits (kept on the worker as one attribute)."""

    backend: str
    bucket_size_bytes: int
    engine_kwargs: dict[str, Any]
    rank_offset: int
    verify: bool
    engine: CheckpointEngine
    weight_version: int = 0
    current: bool = True  # the weights vLLM loaded at start-up are a consistent model
    loaded_refit: int | None = None  # refit index loaded completely, awaiting commit
    heap_trimmed: bool = False  # the last refit handed its freed heap back as it ended
    layout: WeightLayout | None = None  # what this rank keeps, when the trainer sends shards
    last_error: str | None = None

    def status(self, rank: int) -> dict[str, Any]:
        return {
            "rank": rank,
            "weight_version": self.weight_version,
            "current": self.current,
            "last_error": self.last_error,
            "rss_bytes": rss_bytes(),
        }


@dataclasses.dataclass
class _ReceiveTally:
    """What one refit's receive stream noted: digests (with ``verify``), bytes cloned, time
    spent waiting for batches (the rest of a refit's wall time is vLLM loading)."""

    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    cloned_bytes: int = 0
    wait_seconds: float = 0.0  # in the engine, waiting for the next batch


def _accepts_option(backend: str, option: str) -> bool:
    """Whether ``backend``'s engine class declares ``option`` in its options schema."""
    schema = schema_of(resolve_backend(backend))
    return schema is not None and option in schema.names()


def _lent_by(state: _RankState) -> Callable[[torch.Tensor], bool]:
    """Whether a received tensor shows memory the engine lends (valid until the next batch)."""
    lends = getattr(state.engine, "lends", None)
    if callable(lends):
        return lambda tensor: bool(lends(tensor))
    # A third-party engine that borrows but cannot say which tensors it lends: all of them are
    # taken as lent, so whatever vLLM still holds of a batch is cloned.
    borrowed = bool(state.engine_kwargs.get("borrow_received_tensors"))
    return lambda tensor: borrowed


def _replying(method: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """Run ``method``; its value or its exception as a plain reply record."""

    def replying(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": True, "result": method(self, *args, **kwargs)}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver
            return error_reply(exc)

    replying.__name__ = method.__name__
    replying.__qualname__ = method.__qualname__
    replying.__doc__ = method.__doc__
    return replying


class CkptEngineWorkerExtension:
    """Methods vLLM mixes into each of its workers (see the module docstring)."""

    # Set by vLLM's worker; declared for readers and type checkers.
    rank: int
    model_runner: Any
    vllm_config: Any
    _ckpt_engine_state: _RankState | None

    def _ckpt_engine(self) -> _RankState:
        state = getattr(self, "_ckpt_engine_state", None)
        if state is None:
            raise LifecycleError("no checkpoint engine on this vLLM worker: call ckpt_engine_create first")
        return state

    @_replying
    def ckpt_engine_create(
        self,
        backend: str,
        bucket_size_bytes: int,
        engine_kwargs: dict[str, Any] | None = None,
        rank_offset: int = 0,
        verify: bool = False,
        host_pool_bytes: int = 0,
    ) -> dict[str, Any]:
        """Build this rank's engine (``create_checkpoint_engine(backend, ...)``); its rollout rank
        is ``rank_offset`` + this worker's rank. ``verify`` adds a digest of every received
        tensor to refit reports (for a coordinator that checks them against the sender's).
        ``host_pool_bytes`` limits ckpt-core's pool of freed received-tensor memory in this
        worker (``ckpt_core.host_pool.limit_host_pool``). A backend that has the option
        ``borrow_received_tensors`` gets it on unless ``engine_kwargs`` says otherwise: batches
        then go into vLLM as views of the transport's buffers, and only the weights vLLM keeps
        past a batch (those of a layer not complete yet) are copied."""
        previous = getattr(self, "_ckpt_engine_state", None)
        if previous is not None:
            raise LifecycleError("this vLLM worker has a checkpoint engine already: finalize it first")
        kwargs = dict(engine_kwargs or {})
        if "borrow_received_tensors" not in kwargs and _accepts_option(backend, "borrow_received_tensors"):
            # The loader makes what vLLM keeps its own at every batch boundary
            # (loading.own_pending_weights), so borrowing is safe here and saves a copy of
            # every byte; say borrow_received_tensors=False to receive owned tensors.
            kwargs["borrow_received_tensors"] = True
        limit_host_pool(host_pool_bytes)
        engine = create_checkpoint_engine(backend, bucket_size_bytes=bucket_size_bytes, engine_kwargs=dict(kwargs))
        self._ckpt_engine_state = _RankState(backend, bucket_size_bytes, kwargs, rank_offset, verify, engine)
        return self._ckpt_engine_state.status(self._ckpt_engine_rollout_rank())

    def _ckpt_engine_rollout_rank(self) -> int:
        state = self._ckpt_engine_state
        return (state.rank_offset if state is not None else 0) + int(self.rank)

    @_replying
    def ckpt_engine_prepare(self) -> Any:
        """``engine.prepare()``, with this worker's rollout ``rank`` added to dict metadata (as
        NeMo RL's vLLM workers do, so an orchestrator can order the entries). With
        ``shard_expert_weights`` in the engine options, also this rank's ``weight_layout``,
        derived from the live model (:func:`ckpt_vllm.layout.derive_weight_layout`): the
        trainer's engine then sends this rank only the shards it keeps."""
        state = self._ckpt_engine()
        metadata = state.engine.prepare()
        if isinstance(metadata, dict):
            metadata = {**metadata, "rank": self._ckpt_engine_rollout_rank()}
            if state.engine_kwargs.get("shard_expert_weights"):
                state.layout = derive_weight_layout(self.model_runner.get_model())
                metadata["weight_layout"] = state.layout.to_json()
        return metadata

    @_replying
    def ckpt_engine_init(self, *, train_world_size: int, rollout_world_size: int, metadata: list[Any]) -> None:
        """``engine.init_rollout_process_group`` for this worker's rollout rank."""
        self._ckpt_engine().engine.init_rollout_process_group(
            rollout_rank=self._ckpt_engine_rollout_rank(),
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )

    @_replying
    def ckpt_engine_refit(self, *, refit_index: int = 0) -> dict[str, Any]:
        """Receive one refit and stream it into the model; a report of what arrived.

        The rank is not current from the first byte on; on success it waits for
        ``ckpt_engine_commit``. On failure the error is recorded, the engine is finalized (its
        peer sees the connection close instead of waiting out its deadline) and must be
        replaced with ``ckpt_engine_reset`` before the next refit.
        """
        state = self._ckpt_engine()
        state.current = False
        state.loaded_refit = None
        if not state.heap_trimmed:  # later refits start from the trim the last one ended with
            release_free_heap()
        peak_known = reset_peak_rss()
        rss_before = rss_bytes()
        tally = _ReceiveTally()
        start = time.perf_counter()
        stream = self._ckpt_engine_received(state, tally)
        try:
            tensors, nbytes = load_streamed_weights(self, stream)
        except BaseException as exc:
            state.last_error = f"refit {refit_index}: {type(exc).__name__}: {exc}"
            try:
                stream.close()  # end the engine's receive first (observers hear it failed)...
            except Exception:  # noqa: BLE001 - the refit's error is the one to report
                pass
            try:
                state.engine.finalize()  # ...then drop its connections: the peer sees them close
            except Exception:  # noqa: BLE001 - the refit's error is the one to report
                pass
            raise
        finally:
            # What vLLM's reload allocated and freed (each layer is materialized anew) goes
            # back to the system, so the worker's RSS between refits stays that of its model
            # and buffers (measured: without it, RSS climbed ~290 MiB over the first refits
            # of a 124 MB model before levelling off).
            state.heap_trimmed = release_free_heap()
        seconds = time.perf_counter() - start
        state.loaded_refit = refit_index
        state.last_error = None
        stats = getattr(state.engine, "last_stats", None)
        return {
            "role": "rollout",
            "rank": self._ckpt_engine_rollout_rank(),
            "tensors": tensors,
            "bytes": nbytes,
            "wall_seconds": seconds,
            "stats": stats.to_dict() if stats is not None else None,
            "digests": tally.digests,
            "pending_cloned_bytes": tally.cloned_bytes,
            "receive_wait_seconds": tally.wait_seconds,
            "rss_before_bytes": rss_before,
            "peak_rss_bytes": peak_rss_bytes() if peak_known else None,
        }

    def _ckpt_engine_received(
        self, state: _RankState, tally: _ReceiveTally
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The engine's received batches as one stream of ``(name, tensor)``, pulled as vLLM
        loads them (so at most the engine's own buffers and vLLM's pending layer are held).
        With borrowed batches, what vLLM still holds of a batch is cloned before the next one
        is asked for (:func:`~ckpt_vllm.loading.own_pending_weights`). A tensor is lent when the
        engine says so (``BucketedEngine.lends``: by the memory it views, so a weight that fills
        its bucket exactly counts too); for an engine that cannot say, every tensor of a
        borrowed batch is."""
        batches = state.engine.receive_weight_batches()
        guard = HeapGuard(budget_bytes=2 * state.bucket_size_bytes + GROWTH_ALLOWANCE_BYTES)
        lent_by = _lent_by(state)
        model = self.model_runner.get_model()
        # vLLM calls its worker's methods synchronously and its loader pulls one weight at a
        # time, so the batches are stepped on a loop of our own (the transfer itself runs on
        # the engine's refit thread; this loop only waits for each batch).
        loop = asyncio.new_event_loop()
        try:
            while True:
                guard.check()
                asked = time.perf_counter()
                try:
                    batch = loop.run_until_complete(batches.__anext__())
                except StopAsyncIteration:
                    return
                finally:
                    tally.wait_seconds += time.perf_counter() - asked
                lent: set[int] = set()
                batch.reverse()
                while batch:  # drop the batch's reference to each tensor once vLLM has it
                    name, tensor = batch.pop()
                    if lent_by(tensor):
                        lent.add(tensor.untyped_storage().data_ptr())
                    if state.verify:
                        tally.digests[name] = tensor_digest(tensor)
                    kept = state.layout.find(name) if state.layout is not None else None
                    if kept is not None:
                        tensor = full_weight(name, tensor, kept)  # where vLLM reads it
                    yield name, tensor
                    del tensor
                if lent:  # before the next batch refills the buffers these tensors view
                    tally.cloned_bytes += own_pending_weights(model, lent)
        finally:
            loop.run_until_complete(batches.aclose())
            loop.close()

    @_replying
    def ckpt_engine_commit(self, *, weight_version: int) -> dict[str, Any]:
        """Mark the refit just loaded as ``weight_version``, current. Called by the driver once
        every rank loaded the whole refit; refused on a rank that did not."""
        state = self._ckpt_engine()
        if state.loaded_refit is None:
            raise LifecycleError(
                f"rank {self._ckpt_engine_rollout_rank()} has no completely loaded refit to commit"
                + (f" (last error: {state.last_error})" if state.last_error else "")
            )
        state.weight_version = weight_version
        state.current = True
        state.loaded_refit = None
        return state.status(self._ckpt_engine_rollout_rank())

    @_replying
    def ckpt_engine_discard(self) -> dict[str, Any]:
        """Forget the refit just loaded without committing it (the driver rejected it: its
        digests or tensor counts differ from what was sent). The rank stays not current, and
        ``ckpt_engine_commit`` refuses until a new refit loads completely."""
        state = self._ckpt_engine()
        if state.loaded_refit is not None:
            state.last_error = f"refit {state.loaded_refit}: loaded, then rejected by the driver"
        state.loaded_refit = None
        state.current = False
        return state.status(self._ckpt_engine_rollout_rank())

    @_replying
    def ckpt_engine_status(self) -> dict[str, Any]:
        """``{"rank", "weight_version", "current", "last_error", "rss_bytes",
        "parameter_bytes"}`` of this rank (``parameter_bytes``: its parameters in checkpoint
        format, the shards it keeps and what it replicates)."""
        status = self._ckpt_engine().status(self._ckpt_engine_rollout_rank())
        return {**status, "parameter_bytes": checkpoint_parameter_bytes(self.model_runner.get_model())}

    @_replying
    def ckpt_engine_reset(self) -> dict[str, Any]:
        """Replace this rank's engine with a fresh one of the same backend and options (after
        a failed refit); the weight version and the not-current mark stay."""
        state = self._ckpt_engine()
        try:
            state.engine.finalize()
        except Exception:  # noqa: BLE001 - the old engine is being thrown away
            pass
        state.engine = create_checkpoint_engine(
            state.backend, bucket_size_bytes=state.bucket_size_bytes, engine_kwargs=dict(state.engine_kwargs)
        )
        state.loaded_refit = None
        return state.status(self._ckpt_engine_rollout_rank())

    @_replying
    def ckpt_engine_finalize(self) -> None:
        """``engine.finalize()`` and forget the engine (``ckpt_engine_create`` may follow)."""
        state = self._ckpt_engine()
        self._ckpt_engine_state = None
        state.engine.finalize()
