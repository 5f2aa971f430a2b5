"""ckpt-engine as a vLLM weight-transfer backend: the inference worker's side.

vLLM creates one :class:`CkptWeightTransferEngine` in every worker (each tensor-parallel rank)
when its config says ``weight_transfer_config={"backend": "ckpt"}`` (``vllm serve
--weight-transfer-config '{"backend": "ckpt"}'``); :func:`ckpt_vllm.plugin.register` makes the
name known. vLLM's calls map onto ckpt-core's seed lifecycle:

* ``init_weight_transfer_engine(init_info)`` (:class:`CkptInitInfo`): build the transport's
  engine (``create_checkpoint_engine(init_info["transport"], ...)``), ``prepare()`` it, learn
  every peer's metadata (from the trainer's rendezvous, or given whole by a driver that
  gathered it), then ``init_rollout_process_group``. Again after a failure: a fresh engine.
* ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``: one
  ``update_weights`` receives one whole refit (``receive_weight_batches``) and streams it
  through vLLM's layerwise reload as it arrives (:class:`~ckpt_vllm.model.loading.LayerwiseLoad`),
  borrowed batches and destination layouts included; it fails, naming the weight, on anything
  vLLM refuses or leaves unloaded. ``finish_weight_update`` marks the rank current; vLLM then
  moves the engine's weight version, so the version moves only when every rank loaded the
  whole refit.
* ``shutdown_weight_transfer_engine``: ``finalize()``.

A failed update finalizes this rank's engine at once (the trainer sees its connections close
instead of waiting out its deadline) and leaves the rank not current until a new
``init_weight_transfer_engine`` and a complete update, which zeroes the rank's KV cache first
(what a broken model served may have left there: :mod:`ckpt_vllm.model.kv_cache`). Nothing
here resets vLLM's prefix cache (it lives in the scheduler, out of a worker's reach): pause with
``clear_cache=true`` around a refit, or reset it after (``VllmRollout`` does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ckpt_vllm.plugin import require_ckpt_core

require_ckpt_core()

from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import InvalidArgumentError, LifecycleError
from ckpt_core.host_pool import limit_host_pool
from ckpt_core.options import (
    MAX_TIMEOUT_S,
    check_bool,
    check_bucket_size,
    check_count,
    check_kwargs_shape,
    check_positive_number,
    schema_of,
)
from ckpt_core.orchestration.rendezvous import exchange_metadata
from ckpt_core.orchestration.workload import tensor_digest
from ckpt_core.refit.layout import WeightLayout
from ckpt_core.registry import create_checkpoint_engine, resolve_backend
from ckpt_core.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
from ckpt_vllm.errors import WorkersFailedError
from ckpt_vllm.model.kv_cache import clear_kv_caches
from ckpt_vllm.model.loading import LayerwiseLoad, own_pending_weights
from ckpt_vllm.model.model_layout import checkpoint_parameter_bytes, derive_weight_layout, full_weight
from ckpt_vllm.model.model_quantization import derive_weight_quantization
from ckpt_vllm.weight_transfer.heap import GROWTH_ALLOWANCE_BYTES, HeapGuard

_OWNER = "ckpt weight-transfer init_info"

RENAMED_FIELDS: dict[str, tuple[str, str]] = {
    "timeout_s": (
        "rendezvous_timeout_s",
        "it bounds only the wait for the trainer's rendezvous; the engine's own timeout_s, which bounds every "
        "wait of a refit, is an engine option: give it in engine_kwargs",
    ),
}
"""Fields of :class:`CkptInitInfo` that were renamed: old name -> (new name, why). An init info
that still uses an old name is refused, naming the new one, so that no value meant for one
bound silently sets another."""


@dataclasses.dataclass
class CkptInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` takes (one dict, the same for every worker).

    ``transport``, ``bucket_size_bytes`` and ``engine_kwargs`` build the engine, as
    ``create_checkpoint_engine`` takes them (any installed backend, by its name). Peers'
    metadata comes from ``rendezvous`` (``"host:port"`` of a
    :class:`~ckpt_core.orchestration.rendezvous.MetadataRendezvous`, the trainer's), or whole in
    ``metadata`` (a driver that gathered every worker's ``prepare()``, after
    ``ckpt_engine_prepare``); exactly one of the two. ``train_world_size`` policy ranks send;
    this engine's workers are rollout ranks ``rank_offset`` + their data-parallel-global rank,
    of ``rollout_world_size`` (default: this engine's workers). ``rendezvous_timeout_s`` bounds
    the wait at the rendezvous (the engine's own ``timeout_s`` is one of its options, in
    ``engine_kwargs``; the old name of this field is refused, see :data:`RENAMED_FIELDS`).
    ``host_pool_bytes`` limits ckpt-core's pool of freed received memory in each worker
    (default 0: off, see ``VllmRollout``); ``verify`` records a digest of every received tensor
    in the update's report."""

    transport: str = ""
    bucket_size_bytes: int = 0
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    rendezvous: str | None = None
    metadata: list[Any] | None = None
    train_world_size: int = 1
    rollout_world_size: int | None = None
    rank_offset: int = 0
    rendezvous_timeout_s: float = 300.0
    host_pool_bytes: int = 0
    verify: bool = False

    @classmethod
    def from_dict(cls, init_dict: Mapping[str, Any]) -> CkptInitInfo:
        """The init info ``init_dict`` gives (what vLLM's ``init_weight_transfer_engine``
        passes on, from Python or from JSON over HTTP); its values are checked later, by
        :meth:`check`. ``InvalidArgumentError`` for anything but a mapping, for a renamed field
        (:data:`RENAMED_FIELDS`: the message names the new name), and for a name that is no
        field (the message lists the fields)."""
        if not isinstance(init_dict, Mapping):
            raise InvalidArgumentError(f"{_OWNER} must be a dict of field to value, got {type(init_dict).__name__}")
        for old, (new, why) in RENAMED_FIELDS.items():
            if old in init_dict:
                raise InvalidArgumentError(f"{_OWNER}: '{old}' is now called '{new}' ({why})")
        fields = [field.name for field in dataclasses.fields(cls)]
        unknown = [name for name in init_dict if name not in fields]
        if unknown:
            raise InvalidArgumentError(f"{_OWNER}: no field {unknown} (its fields: {fields})")
        return cls(**init_dict)

    def check(self) -> None:
        """``InvalidArgumentError`` (``EngineOptionError`` for engine options) naming the field."""
        self.check_engine_options()
        if (self.rendezvous is None) == (self.metadata is None):
            raise InvalidArgumentError(
                f"{_OWNER}: give exactly one of 'rendezvous' (the trainer's 'host:port') and 'metadata' (every "
                f"worker's prepare() result, from a driver), got rendezvous={self.rendezvous!r} and "
                f"{'no' if self.metadata is None else 'a'} metadata list"
            )
        if self.metadata is not None and not isinstance(self.metadata, list):
            raise InvalidArgumentError(f"{_OWNER}: 'metadata' must be a list, got {type(self.metadata).__name__}")

    def check_engine_options(self) -> None:
        """The fields :meth:`CkptWeightTransferEngine.prepare` needs (all but the peers')."""
        if not isinstance(self.transport, str) or not self.transport:
            raise InvalidArgumentError(
                f"{_OWNER}: 'transport' must name an installed ckpt-core backend (gloo_cpu, nccl, cuda_ipc or a "
                f"third party's: `ckpt-engine list`), got {self.transport!r}"
            )
        check_bucket_size(self.bucket_size_bytes, owner=_OWNER)
        check_kwargs_shape(self.engine_kwargs)
        for name in ("train_world_size", "rank_offset", "host_pool_bytes"):
            check_count(_OWNER, name, getattr(self, name))
        if self.train_world_size < 1:
            raise InvalidArgumentError(f"{_OWNER}: train_world_size must be >= 1, got {self.train_world_size}")
        if self.rollout_world_size is not None:
            check_count(_OWNER, "rollout_world_size", self.rollout_world_size)
        check_positive_number(_OWNER, "rendezvous_timeout_s", self.rendezvous_timeout_s, MAX_TIMEOUT_S)
        check_bool(_OWNER, "verify", self.verify)

    def engine_options(self) -> tuple[str, int, dict[str, Any]]:
        """What the engine is built from: two inits that agree on these share a prepared engine."""
        return self.transport, self.bucket_size_bytes, self.engine_kwargs


@dataclasses.dataclass
class CkptUpdateInfo(WeightTransferUpdateInfo):
    """What ``update_weights`` takes: nothing (``{}``); the refit itself says what it brings."""


@dataclasses.dataclass
class _ReceiveTally:
    """What one update's receive stream noted: digests (with ``verify``), bytes cloned, time
    spent waiting for batches (the rest of an update's wall time is vLLM loading)."""

    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    cloned_bytes: int = 0
    wait_seconds: float = 0.0


class CkptWeightTransferEngine(WeightTransferEngine[CkptInitInfo, CkptUpdateInfo]):
    """One vLLM worker as one rollout rank of ckpt-engine refits (see the module docstring)."""

    init_info_cls = CkptInitInfo
    update_info_cls = CkptUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        parallel = vllm_config.parallel_config
        self.worker_rank = int(parallel.data_parallel_index) * int(parallel.world_size) + int(parallel.rank)
        self.engine_workers = int(parallel.world_size_across_dp)
        self.info: CkptInitInfo | None = None
        self.engine: CheckpointEngine | None = None
        self.engine_kwargs: dict[str, Any] = {}  # what the engine was built with, defaults added
        self.prepared: tuple[str, int, dict[str, Any]] | None = None  # options of an engine prepare()d ahead
        self.layout: WeightLayout | None = None
        self.current = True  # the weights vLLM loaded at start-up are a consistent model
        self.loaded = False  # the open update loaded a whole refit, not rejected since
        self.last_error: dict[str, str] | None = None
        self.cache_suspect = False
        """An update failed or was discarded since the KV cache was last cleared: the model may
        have served meanwhile with weights that are not a model (:mod:`ckpt_vllm.model.kv_cache`)."""
        self.last_report: dict[str, Any] | None = None
        self._updating = False
        self._refused: Exception | None = None  # what parse_init_info refused, for init to settle

    @property
    def rollout_rank(self) -> int:
        return (self.info.rank_offset if self.info is not None else 0) + self.worker_rank

    # -- init ------------------------------------------------------------------------------
    def prepare(self, info: CkptInitInfo) -> Any:
        """Build a fresh engine from ``info`` (an old one is finalized) and return its
        ``prepare()`` metadata, with this worker's rollout ``rank`` (as NeMo RL's vLLM workers
        add it) and, with ``shard_expert_weights``, the ``weight_layout`` derived from the live
        model; with ``quantize_for_rollout``, the ``weight_quantization`` it holds (an FP8
        model: :mod:`ckpt_vllm.model.model_quantization`). A backend with the option
        ``borrow_received_tensors`` gets it on unless ``engine_kwargs`` says otherwise: batches
        then go into vLLM as views of the transport's buffers, and only what vLLM keeps past a
        batch is copied (``own_pending_weights``)."""
        info.check_engine_options()
        self._drop_engine()
        kwargs = dict(info.engine_kwargs)
        if "borrow_received_tensors" not in kwargs and _accepts_option(info.transport, "borrow_received_tensors"):
            kwargs["borrow_received_tensors"] = True
        limit_host_pool(info.host_pool_bytes)
        self.info, self.engine_kwargs = info, kwargs
        self.engine = create_checkpoint_engine(
            info.transport, bucket_size_bytes=info.bucket_size_bytes, engine_kwargs=kwargs
        )
        metadata = self.engine.prepare()
        if isinstance(metadata, dict):
            metadata = {**metadata, "rank": self.rollout_rank}
            if kwargs.get("shard_expert_weights"):
                self.layout = derive_weight_layout(self.model)
                metadata["weight_layout"] = self.layout.to_json()
            if kwargs.get("quantize_for_rollout"):
                spec = derive_weight_quantization(
                    self.layout or derive_weight_layout(self.model), self.vllm_config.model_config.dtype
                )
                if spec is None:
                    raise InvalidArgumentError(
                        "quantize_for_rollout=True, but this vLLM model holds no FP8 weights (no weight_scale or "
                        "weight_scale_inv beside its weights): serve an FP8 checkpoint, or turn the option off"
                    )
                metadata["weight_quantization"] = spec.to_json()
        self.prepared = info.engine_options()
        return metadata

    def parse_init_info(self, init_dict: dict[str, Any]) -> CkptInitInfo:
        # vLLM parses in every worker before init_transfer_engine; a refusal there would be
        # raised by every worker (see settle() for why that must not be), so it is kept for
        # init_transfer_engine to settle.
        self._refused = None
        try:
            return CkptInitInfo.from_dict(init_dict)
        except InvalidArgumentError as exc:
            self._refused = exc
            return CkptInitInfo()

    def init_transfer_engine(self, init_info: CkptInitInfo) -> None:
        try:
            if self._refused is not None:
                raise self._refused
            init_info.check()
            rollout_world_size = init_info.rollout_world_size or self.engine_workers
            if init_info.metadata is not None:
                if self.engine is None or self.prepared != init_info.engine_options():
                    raise LifecycleError(
                        "init_info carries every worker's metadata, but this worker's engine was not prepared with "
                        "the same transport, bucket_size_bytes and engine_kwargs: call ckpt_engine_prepare with "
                        "them first (or give 'rendezvous' instead of 'metadata')"
                    )
                self.info = dataclasses.replace(init_info, metadata=None)
                metadata = init_info.metadata
            else:
                own = self.prepare(init_info)
                assert init_info.rendezvous is not None  # check() guarantees one of the two
                metadata = exchange_metadata(
                    init_info.rendezvous,
                    role="rollout",
                    rank=self.rollout_rank,
                    entry=own,
                    train_world_size=init_info.train_world_size,
                    rollout_world_size=rollout_world_size,
                    timeout_s=init_info.rendezvous_timeout_s,
                )
            self.prepared = None
            assert self.engine is not None
            self.engine.init_rollout_process_group(
                rollout_rank=self.rollout_rank,
                train_world_size=init_info.train_world_size,
                rollout_world_size=rollout_world_size,
                metadata=metadata,
            )
        except Exception as exc:  # noqa: BLE001 - settled with the other workers below
            self._fail("init", exc)
            settle("init_weight_transfer_engine", exc)
            return
        self.last_error = None
        settle("init_weight_transfer_engine", None)

    # -- one update ------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        self._updating = True
        self.loaded = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default ends with torch.accelerator.synchronize(), which raises where there is
        # no accelerator (the CPU build); received tensors are loaded before this returns.
        self.last_error = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - settled with the other workers below
            if self.last_error is None:  # refused before receiving (a bad update_info)
                self.last_error = {"error_type": type(exc).__name__, "message": f"update: {exc}"}
            settle("update_weights", exc)
            return
        settle("update_weights", None)

    def receive_weights(self, update_info: CkptUpdateInfo) -> None:
        """Receive one whole refit and stream it into the model; its report goes to
        :attr:`last_report`. The rank is not current from the first byte on."""
        engine = self._engine()
        if not self._updating:
            raise LifecycleError("update_weights before start_weight_update")
        self.current = False
        self.loaded = False
        reset_peak_rss()  # peak_rss_bytes() is then this refit's peak (None where the kernel refuses)
        rss_before = rss_bytes()
        tally = _ReceiveTally()
        started, cpu_started = time.perf_counter(), time.process_time()
        # What vLLM's reload allocates and frees (each layer is materialized anew) stays in
        # glibc's heap for the next refit to reuse: handing it back at every refit made the
        # next one fault it all in again (measured, 124 MB model: refits 0.275 s against 0.208
        # s without, for ~40 MiB of RSS). The guard hands it back only past its budget.
        assert self.info is not None  # an engine is built from it
        guard = HeapGuard(budget_bytes=2 * self.info.bucket_size_bytes + GROWTH_ALLOWANCE_BYTES)
        update = LayerwiseLoad(self.model, self.vllm_config)
        stream = self._received(engine, tally, guard)
        try:
            update.start()
            tensors, nbytes = update.load(stream)
            update.finish()
            guard.check()  # what vLLM's post-load processing left, too
            cleared = clear_kv_caches(self.model) if self.cache_suspect else 0
        except BaseException as exc:
            update.abandon()
            try:
                stream.close()  # end the engine's receive first (observers hear it failed)...
            except Exception:  # noqa: BLE001 - the update's error is the one to report
                pass
            self._fail("update", exc)  # ...then drop its connections: the peer sees them close
            raise
        self.loaded = True
        self.last_error = None
        self.cache_suspect = False
        stats = getattr(engine, "last_stats", None)
        self.last_report = {
            "role": "rollout",
            "rank": self.rollout_rank,
            "tensors": tensors,
            "bytes": nbytes,
            "wall_seconds": time.perf_counter() - started,
            "cpu_seconds": time.process_time() - cpu_started,  # the worker process's threads, all of them
            "stats": stats.to_dict() if stats is not None else None,
            "digests": tally.digests,
            "pending_cloned_bytes": tally.cloned_bytes,
            "receive_wait_seconds": tally.wait_seconds,
            "heap_trims": guard.trims,
            "rss_before_bytes": rss_before,
            "peak_rss_bytes": peak_rss_bytes(),
            "kv_cache_cleared_bytes": cleared,
        }

    def finish_weight_update(self) -> None:
        """The rank is current again when this update loaded a whole refit that was not
        rejected (:meth:`discard`); with nothing loaded, nothing changed. Never raises: vLLM
        leaves its worker in the update when this does. A refused update raised already, in
        ``update_weights``, and vLLM moves no version after that."""
        if self.loaded:
            self.current = True
        self.loaded = False
        self._updating = False

    def discard(self) -> None:
        """Reject the refit the open update loaded (a driver found its digests or counts differ
        from what was sent): the rank stays not current, and the ``finish_weight_update`` that
        must still close the update does not make it current."""
        if self.loaded:
            self.last_error = {
                "error_type": "LifecycleError",
                "message": "the refit was loaded, then rejected by the driver",
            }
            self.cache_suspect = True
        self.loaded = False
        self.current = False

    def shutdown(self) -> None:
        self._drop_engine()

    def receive_adapter(self) -> dict[str, torch.Tensor]:
        """Receive one refit whole, as an adapter's tensors (copies this rank owns, in the
        order sent); the model's weights are not touched. A failed receive drops the engine,
        as a failed update does."""
        engine = self._engine()
        tensors: dict[str, torch.Tensor] = {}
        # Owned: the adapter is held past this refit (a borrowing engine's views are refilled).
        batches = engine.receive_weight_batches_blocking(owned=True)
        try:
            for batch in batches:
                for name, tensor in batch:
                    if name in tensors:
                        raise InvalidArgumentError(f"{name}: sent twice in one adapter refit")
                    tensors[name] = tensor
        except BaseException as exc:
            self._fail("adapter", exc)
            raise
        finally:
            batches.close()
        return tensors

    # -- what vLLM's API does not say ------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """``{"rank", "current", "loaded", "last_error", "rss_bytes", "parameter_bytes"}`` of this
        rank (``loaded``: the open update loaded a whole refit, not rejected; ``last_error``:
        ``{"error_type", "message"}`` of the last failed init or update, or ``None``;
        ``parameter_bytes``: its parameters in checkpoint format, the shards it keeps and what
        it replicates)."""
        return {
            "rank": self.rollout_rank,
            "current": self.current,
            "loaded": self.loaded,
            "last_error": self.last_error,
            "rss_bytes": rss_bytes(),
            "parameter_bytes": checkpoint_parameter_bytes(self.model),
        }

    # -- internals -------------------------------------------------------------------------
    def _engine(self) -> CheckpointEngine:
        if self.engine is None:
            raise LifecycleError(
                "no ckpt-engine on this vLLM worker: call init_weight_transfer_engine first (again after a "
                "failed update or a shutdown)"
            )
        return self.engine

    def _fail(self, step: str, exc: BaseException) -> None:
        self.last_error = {"error_type": type(exc).__name__, "message": f"{step}: {exc}"}
        if step == "update":
            self.cache_suspect = True
        self._drop_engine()

    def _drop_engine(self) -> None:
        engine, self.engine, self.layout, self.prepared = self.engine, None, None, None
        if engine is not None:
            try:
                engine.finalize()
            except Exception:  # noqa: BLE001 - the engine is being thrown away
                pass

    def _received(
        self, engine: CheckpointEngine, tally: _ReceiveTally, guard: HeapGuard
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The engine's received batches as one stream of ``(name, tensor)``, pulled as vLLM
        loads them (so at most the engine's own buffers and vLLM's pending layer are held).
        With borrowed batches, what vLLM still holds of a batch is cloned before the next one
        is asked for (:func:`~ckpt_vllm.model.loading.own_pending_weights`). A tensor is lent
        when the engine says so (``BucketedEngine.lends``: by the memory it views, so a weight
        that fills its bucket exactly counts too); for an engine that cannot say, every tensor
        of a borrowed batch is."""
        assert self.info is not None
        # vLLM calls its workers synchronously and its loader pulls one weight at a time: the
        # refit is stepped on this thread, with no event loop or refit thread between.
        batches = engine.receive_weight_batches_blocking()
        lent_by = _lent_by(engine, self.engine_kwargs)
        try:
            while True:
                guard.check()
                asked = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                finally:
                    tally.wait_seconds += time.perf_counter() - asked
                lent: set[int] = set()
                batch.reverse()
                while batch:  # drop the batch's reference to each tensor once vLLM has it
                    name, tensor = batch.pop()
                    if lent_by(tensor):
                        lent.add(tensor.untyped_storage().data_ptr())
                    if self.info.verify:
                        tally.digests[name] = tensor_digest(tensor)
                    kept = self.layout.find(name) if self.layout is not None else None
                    if kept is not None:
                        tensor = full_weight(name, tensor, kept)  # where vLLM reads it
                    yield name, tensor
                    del tensor
                if lent:  # before the next batch refills the buffers these tensors view
                    tally.cloned_bytes += own_pending_weights(self.model, lent)
        finally:
            batches.close()


def _accepts_option(backend: str, option: str) -> bool:
    """Whether ``backend``'s engine class declares ``option`` in its options schema."""
    schema = schema_of(resolve_backend(backend))
    return schema is not None and option in schema.names()


def _lent_by(engine: CheckpointEngine, engine_kwargs: dict[str, Any]) -> Callable[[torch.Tensor], bool]:
    """Whether a received tensor shows memory the engine lends (valid until the next batch)."""
    lends = getattr(engine, "lends", None)
    if callable(lends):
        return lambda tensor: bool(lends(tensor))
    # A third-party engine that borrows but cannot say which tensors it lends: all of them are
    # taken as lent, so whatever vLLM still holds of a batch is cloned.
    borrowed = bool(engine_kwargs.get("borrow_received_tensors"))
    return lambda tensor: borrowed


_MESSAGE_BYTES = 4096  # of each worker's error, as the others learn it


def settle(step: str, failure: BaseException | None) -> None:
    """Every worker of this vLLM engine learns whether ``step`` failed on any of them; then the
    last worker alone raises, for all (:class:`~ckpt_vllm.errors.WorkersFailedError` naming each
    failed worker and its error), and the others return, their own error in their status.

    Why only one: vLLM's multiprocess executor reads its workers' replies in rank order and
    stops at the first failure, leaving the later workers' replies queued, where the next call
    reads them as its own (every later call then gets another call's reply). The last worker's
    reply is read last, so its failure leaves nothing behind. The error names each worker's
    error type too (vLLM passes on only the text of what a worker raised). A collective of the
    engine's own workers (vLLM's world group, on its CPU group): every worker is in the same
    call.
    """
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    said = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[:_MESSAGE_BYTES]
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if said:
        mine[: len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
    if group.world_size == 1:
        everyone = [mine]
    else:
        everyone = [torch.empty_like(mine) for _ in range(group.world_size)]
        torch.distributed.all_gather(everyone, mine, group=group.cpu_group)
    failed = {
        rank: bytes(message.numpy()).rstrip(b"\0").decode(errors="replace")
        for rank, message in enumerate(everyone)
        if int(message[0]) != 0
    }
    if failed and group.rank_in_group == group.world_size - 1:
        shown = "; ".join(f"worker {rank}: {message}" for rank, message in failed.items())
        raise WorkersFailedError(f"{step} failed on {len(failed)} of {group.world_size} workers: {shown}") from failure
