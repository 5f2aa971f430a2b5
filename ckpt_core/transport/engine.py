"""``BucketedEngine``: the seed lifecycle over the shared pipeline, for transports to subclass.

A transport subclasses it and answers only how peers meet and how one buffer moves, through the
hooks of :class:`~ckpt_core.transport.hooks.TransportHooks` (``_connect_policy`` and
``_connect_rollout`` return a sender and a receiver; the others have defaults).

This class owns the rest: option and metadata validation (:mod:`.engine_options`,
:mod:`._init_checks`), the lifecycle state machine (:mod:`._lifecycle`: a clear
``LifecycleError`` for an out-of-order call, one refit at a time), the refit kinds (its
``refit_stages``, run as :mod:`ckpt_core.refit.stage` describes), refit numbering, the refit's
own thread (:mod:`._refit_thread`), hooks and statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import torch

from ckpt_core._internal.agreement import AGREED_KEY
from ckpt_core._internal.bucket_io import BucketReceiver, BucketSender
from ckpt_core._internal.fanout import Destination, send_refit_each
from ckpt_core._internal.pipeline import RefitCancelled
from ckpt_core._internal.receive import ReceiveMemo, ReceiveProgress, receive_refit
from ckpt_core._internal.replay import PackingRecord
from ckpt_core._internal.send import send_refit
from ckpt_core._internal.wire import FORMAT_VERSION
from ckpt_core.contract import CheckpointEngine, refuse_running_loop
from ckpt_core.errors import LayoutUnavailableError, WireFormatError
from ckpt_core.hooks import RefitNotifier
from ckpt_core.options import OptionSchema, OptionValues, check_bool, document_options
from ckpt_core.refit.delta.stage import DeltaStage
from ckpt_core.refit.layout.stage import LayoutStage
from ckpt_core.refit.quantize.stage import QuantizeStage
from ckpt_core.refit.stage import Destinations, RefitStage, Stream, Weights, stage_options
from ckpt_core.stats import RefitContext, RefitStats, Role
from ckpt_core.transport._init_checks import checked_metadata
from ckpt_core.transport._lifecycle import Lifecycle, Phase
from ckpt_core.transport._refit_thread import RefitCarrier, RefitThread
from ckpt_core.transport.engine_options import ENGINE_OPTIONS
from ckpt_core.transport.hooks import TransportHooks

BORROWS_KEY = "borrows_received_tensors"
"""In a rollout's ``prepare()`` metadata when it borrows: its senders then pack every chunk into
their bucket buffers (no direct chunks), since only bytes that arrived in a buffer can be lent."""


_Kind = TypeVar("_Kind", bound=RefitStage)


class BucketedEngine(TransportHooks, CheckpointEngine):
    """Base of engines built on the shared bucket pipeline.

    Its options are declared once, in ``options`` (an :class:`~ckpt_core.options.OptionSchema`,
    listed at the end of this docstring; what each means: :mod:`ckpt_core.transport.engine_options`
    and the stage modules of ``refit_stages``): a subclass inherits them and assigns
    ``options = BucketedEngine.options.extend(...)`` (or ``.replace(...)``) to add or narrow its
    own; the constructor, written once here, parses every keyword through the class's schema
    (``EngineClass(bucket_size=..., **options)``, as NeMo RL builds engines) into
    ``self.option_values``, and an unknown name is an ``EngineOptionError`` naming the accepted
    options and the closest.

    What a subclass provides (the rest is this class's and the pipeline's):

    * ``backend_name``: its entry-point name, required of every concrete subclass;
    * the hooks of :class:`~ckpt_core.transport.hooks.TransportHooks`: ``_connect_policy``
      and ``_connect_rollout`` (a sender / receiver), the others where their defaults do not fit;
    * ``options``, where it has options of its own (a ``topology`` option, of type
      :class:`~ckpt_core.topology.Topology`, sets who sends to whom; without one, policy rank
      0 feeds every rollout rank);
    * ``refit_stages``, only to run a refit kind of its own (:mod:`ckpt_core.refit.stage`).

    Every other underscore name is private to this class.
    """

    options: ClassVar[OptionSchema] = ENGINE_OPTIONS
    """Every option of this engine class, declared once (see the class docstring); the
    options of its ``refit_stages`` are added to it when the class is defined."""

    refit_stages: ClassVar[tuple[type[RefitStage], ...]] = (QuantizeStage, LayoutStage, DeltaStage)
    """The refit kinds this engine runs, in the order they wrap a refit's weights (quantize
    before layouts select, so scales follow their weights; delta last: patches of what each
    destination keeps)."""

    backend_name: ClassVar[str]
    """The entry-point name; stamped into metadata so engines of another backend are refused.
    A concrete subclass that does not set it is refused when the class is defined."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ABCMeta computes __abstractmethods__ after this hook runs, so look for them here.
        abstract = any(getattr(getattr(cls, name, None), "__isabstractmethod__", False) for name in dir(cls))
        name = getattr(cls, "backend_name", None)
        if not abstract and (not isinstance(name, str) or not name):
            raise TypeError(
                f"{cls.__qualname__} must set backend_name = '<its entry-point name>' (a non-empty "
                f"string; it is stamped into prepare() metadata), got {name!r}"
            )
        schema = cls.__dict__.get("options")
        if schema is not None and not isinstance(schema, OptionSchema):
            raise TypeError(
                f"{cls.__qualname__}.options must be an OptionSchema (BucketedEngine.options.extend(...)), "
                f"got {type(schema).__name__}"
            )
        cls.options = cls.options.extend(*stage_options(cls.__qualname__, cls.refit_stages, cls.options))
        document_options(cls)

    def __init__(self, *, bucket_size: int, **options: Any) -> None:
        """Parse ``bucket_size`` and ``options`` through ``type(self).options``: an unknown
        name, a missing required option or a bad value is an ``EngineOptionError``.
        Subclasses that keep state of their own define ``__init__(self, **options)``, call
        this first and read ``self.option_values``; they never restate the options."""
        values = type(self).options.parse(type(self).__name__, {"bucket_size": bucket_size, **options})
        self.option_values: OptionValues = values
        """Every option's value, parsed (``self.option_values.timeout_s``)."""
        self.bucket_size: int = values.bucket_size
        self.timeout_s: float = values.timeout_s
        self.checksum: bool = values.checksum
        self.release_after_refit: bool = values.release_after_refit
        self.shard_expert_weights: bool = values.shard_expert_weights
        self.borrow_received_tensors: bool = values.borrow_received_tensors
        owner = type(self).__name__
        stages = (stage.from_options(values, owner=owner) for stage in type(self).refit_stages)
        self._stages: tuple[RefitStage, ...] = tuple(stage for stage in stages if stage is not None)
        """The refit kinds these options switch on, in ``refit_stages`` order; kept across
        ``finalize()`` (a stage may keep state across refits, as delta's baselines)."""
        self._plan: Destinations | None = None  # whom this policy rank sends to, from its init
        self._send_direct = True  # False once a rollout this policy serves borrows (init)
        self.last_stats_by_destination: dict[int, RefitStats] = {}
        """With a stream per destination: each destination's statistics of the last refit."""
        self._life = Lifecycle(type(self).__name__)
        self._engine_id = ""
        self._sender: BucketSender | Mapping[int, BucketSender] | None = None
        self._receiver: BucketReceiver | None = None
        self._carrier: RefitCarrier | None = None  # the refit thread, kept from one refit to the next
        self._carrier_finalizer: weakref.finalize[Any, Any] | None = None  # retires it if the engine is dropped
        # What the last refit sent and received, replayed where the next one repeats it. Kept
        # across finalize() (NeMo RL finalizes after every refit with release_after_refit):
        # a record is replayed only under the settings it was made with, and a receiver reuses
        # a decoding only for a byte-equal chunk list.
        self._packing_record = PackingRecord()
        self._receive_memo = ReceiveMemo()
        self.last_stats: RefitStats | None = None
        """Statistics of this worker's last completed refit."""

    # --- the seed lifecycle ------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        self._life.require(Phase.NEW, "prepare()")
        self._engine_id = uuid.uuid4().hex
        metadata = {"backend": self.backend_name, "format": FORMAT_VERSION, "engine_id": self._engine_id}
        metadata[AGREED_KEY] = self._agreed_settings()
        if self.borrow_received_tensors:  # as a rollout: senders then pack every byte (see init)
            metadata[BORROWS_KEY] = True
        published = [(f"{type(stage).__name__}.publish()", stage.publish()) for stage in self._stages]
        for source, extra in [*published, (f"{type(self).__name__}._prepare_transport()", self._prepare_transport())]:
            clash = sorted(set(extra) & set(metadata))
            if clash:
                raise WireFormatError(
                    f"{source} returned the keys {clash}, which the engine's metadata already holds "
                    f"({sorted(metadata)}): name its keys otherwise"
                )
            metadata.update(extra)
        self._life.phase = Phase.PREPARED
        return metadata

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self._life.require(Phase.PREPARED, "init_policy_process_group()")
        checked = checked_metadata(
            self,
            self._engine_id,
            rank=worker_rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
            role="policy",
        )
        destinations = Destinations(
            owner=type(self).__name__,
            worker_rank=worker_rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=checked,
            ranks=tuple(self._destinations(worker_rank, train_world_size, rollout_world_size)),
            separate=self._separate_streams(),
        )
        for stage in self._stages:  # before connecting: a refused layout costs no connection
            stage.connect_policy(destinations)
        self._sender = self._connect_policy(worker_rank, train_world_size, rollout_world_size, checked)
        connected = self._sender
        if connected is not None and isinstance(connected, Mapping) != destinations.separate:
            raise TypeError(
                f"{type(self).__name__}._connect_policy() returned {type(connected).__name__}, but "
                f"_separate_streams() is {destinations.separate}: return a sender per destination rollout "
                "rank (a mapping) exactly where each gets a stream of its own, else one sender"
            )
        senders = list(connected.values()) if isinstance(connected, Mapping) else [connected] if connected else []
        for stage in self._stages:
            stage.connected([sender.buffer(0).device for sender in senders])
        self._plan = destinations
        # A rollout that borrows can lend only bytes that arrived in its buffers: a direct
        # chunk would land in fresh memory it then owns (allocated, faulted in) instead.
        self._send_direct = not any(entry.get(BORROWS_KEY) for entry in checked[train_world_size:])
        self._life.enter(Phase.POLICY, worker_rank)

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self._life.require(Phase.PREPARED, "init_rollout_process_group()")
        checked = checked_metadata(
            self,
            self._engine_id,
            rank=rollout_rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
            role="rollout",
        )
        self._receiver = self._connect_rollout(rollout_rank, train_world_size, rollout_world_size, checked)
        for stage in self._stages:
            stage.connected([self._receiver.buffer(0).device])
        self._life.enter(Phase.ROLLOUT, rollout_rank)

    def finalize(self) -> None:
        """Release buffers, connections and groups, and end the refit thread; with
        ``release_after_refit``, also the cached memory (see the class docstring). Idempotent;
        ``prepare()`` may follow."""
        try:
            self._drop_transport()
        finally:
            self._retire_carrier()
            self._life.finalized()
            self._plan = None
            for stage in self._stages:
                stage.finalize()
            if self.release_after_refit:
                self._release_cached_memory()

    def lends(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shows memory this rollout engine lends out: a borrowed tensor
        (``borrow_received_tensors``), or any view made from one, whose bytes change once the
        next batch is asked for. Decided by the memory it views (one of the receiver's bucket
        buffers), never by its size: a borrowed tensor may fill its buffer exactly. ``False``
        for tensors the caller owns, and on an engine that lends nothing."""
        receiver = self._receiver
        if receiver is None or not self.borrow_received_tensors or tensor.is_meta:
            return False
        storage = tensor.untyped_storage().data_ptr()
        return any(receiver.buffer(slot).untyped_storage().data_ptr() == storage for slot in range(receiver.num_slots))

    @property
    def delta_baseline_bytes(self) -> int:
        """With ``delta``: the bytes this engine holds as baselines (a copy of what it last
        sent to each destination stream, and of what it last received); 0 without."""
        delta = self._stage(DeltaStage)
        return delta.state.baseline_bytes if delta is not None else 0

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """With ``shard_expert_weights``: the ``"weight_layout"`` of the rollout worker this
        policy worker sends to (``None`` for a policy worker that sends to none and drains its
        weights); where it sends each of several rollout ranks a stream of its own and their
        ckpt-engine layouts differ (topology ``"fanout"``), ``{"<rollout rank>": layout}``.
        Without it: ``None``. ``LayoutUnavailableError`` before ``init_policy_process_group``,
        which is where the layout arrives."""
        if not self.shard_expert_weights:
            return None
        if self._life.phase is not Phase.POLICY:
            raise LayoutUnavailableError(
                f"{type(self).__name__}.get_target_weight_layout(): the layout comes with the rollout "
                f"workers' metadata in init_policy_process_group(), but the engine is {self._life.phase.value}"
            )
        layouts = self._stage(LayoutStage)
        return layouts.target_layout if layouts is not None else None

    def _stage(self, kind: type[_Kind]) -> _Kind | None:
        """This engine's stage of refit kind ``kind``; ``None`` where its options leave it off."""
        return next((stage for stage in self._stages if isinstance(stage, kind)), None)

    def _drop_transport(self) -> None:
        try:
            senders = list(self._sender.values()) if isinstance(self._sender, Mapping) else [self._sender]
            for end in (*senders, self._receiver):
                if end is not None:
                    end.close()
            self._release_transport()
        finally:
            self._sender = self._receiver = None

    def _fail(self) -> None:
        """A refit failed: the stream is out of step, so drop connections at once. Peers
        blocked on this worker then fail now instead of waiting out their ``timeout_s``."""
        self._life.phase = Phase.FAILED
        try:
            self._drop_transport()
        except Exception:  # noqa: BLE001 - the refit's own error is what the caller needs
            pass
        self._retire_carrier()

    def _retire_carrier(self) -> None:
        """A failed or finalized engine holds no thread (a refit after the next init starts one)."""
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            carrier.retire()
        if self._carrier_finalizer is not None:
            self._carrier_finalizer.detach()
            self._carrier_finalizer = None

    def _refit_thread(self, role: Role, **kwargs: Any) -> RefitThread:
        """The thread one refit of this engine runs on (see :mod:`ckpt_core.transport._refit_thread`):
        the engine's carrier, kept from one refit to the next until the engine fails or is
        finalized. The refit waits at most ``timeout_s`` for its next step; stopping it (a
        cancelled refit: the step in flight may finish a transport wait, then abort, each wait
        bounded by ``timeout_s``) is bounded by ``4 * timeout_s`` plus a margin."""
        name = f"ckpt-refit-{self.backend_name}-{role}-{self._life.rank}"
        carrier = self._carrier
        if carrier is None or carrier.name != name or not carrier.usable():
            self._retire_carrier()
            carrier = self._carrier = RefitCarrier(name)
            # An engine dropped unfinalized ends its thread too (at exit, daemon threads just stop).
            self._carrier_finalizer = weakref.finalize(self, carrier.retire)
            self._carrier_finalizer.atexit = False
        return RefitThread(carrier, idle_s=self.timeout_s, stop_s=4 * self.timeout_s + 10.0, **kwargs)

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """Send one refit. Never blocks the event loop: the transfer runs on a thread of its
        own (the engine's, kept from one refit to the next; the refit ends there before this
        returns), and the coroutine awaits it. The weights generator is iterated on that
        thread, with the CUDA device and stream current where this was called (when CUDA is
        initialized); refit hooks fire there too. A policy rank without a receiver drains
        ``weights`` there (its iterator may run collectives with the ranks that do send).
        Errors are raised here with their own types.

        Cancelling the task awaiting this voids the refit: the transfer stops before its next
        weight or bucket (a transport wait in progress ends first, within ``timeout_s``), the
        receivers are sent an abort (they fail with ``RemoteRefitError``), the refit's thread
        is ended, and the engine is failed (``finalize()``, then ``prepare()`` and init again)
        before ``CancelledError`` is raised.

        A yielded tensor must keep its memory and bytes while the sender may still read it:
        small ones are copied before the next weight is asked for; a chunk sent direct (1 MiB
        or more, on transports that take them) is read until the weights yielded after it hold
        more than two buckets' bytes. A generator that frees or refills a weight sooner yields
        a copy of it (docs/reliability.md, "The weights generator"); a weight found freed is an
        ``UnsupportedTensorError``."""
        with self._sending("send_weights()", weights) as refit:
            runner = self._refit_thread("policy")
            try:
                refit.result = await runner.run(functools.partial(refit.run, runner.cancel), ends=_last_step)
            finally:
                await runner.stop()  # the transport is never dropped under a running step

    def send_weights_blocking(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """:meth:`send_weights` run on the calling thread, which it blocks until the refit
        is sent: the same refit, errors and rules for ``weights``, without the hand-offs to
        and from the refit thread (about 0.2 ms each on a busy machine). For callers that
        block anyway (a synchronous worker method, a script). It runs the same refit as
        ``send_weights``, not through it: a subclass that overrides one overrides both. It
        cannot be cancelled; each of its transport waits is bounded by ``timeout_s``.
        ``LifecycleError`` on a thread whose event loop is running."""
        refuse_running_loop("send_weights_blocking()", "await send_weights()")
        with self._sending("send_weights_blocking()", weights) as refit:
            refit.result = refit.run(threading.Event())

    @contextlib.contextmanager
    def _sending(self, call: str, weights: Generator[tuple[str, torch.Tensor], None, None]) -> Iterator[_Send]:
        """One refit of this policy rank around the code that runs it (``refit.run``, given a
        cancel event, on whichever thread): the lifecycle's checks, refit numbering, and on
        failure the stages told and the engine failed."""
        self._life.require(Phase.POLICY, call)
        with self._life.refit_slot(call):
            if self._sender is None:
                yield _Send(functools.partial(_drain, weights))
                self._life.refit_index += 1
                return
            assert self._plan is not None
            notifier = RefitNotifier(self.backend_name, "policy", self._life.rank)
            generation = self._life.generation
            context = notifier.context(self._life.refit_index)
            self.last_stats_by_destination = {}
            wrapped: Weights = weights
            for stage in self._stages:  # once, before the weights are split among streams
                wrapped = stage.send(wrapped)
            refit = _Send(functools.partial(self._send, wrapped, context, notifier))
            try:
                yield refit
            except BaseException as exc:
                for stage in self._stages:
                    stage.send_failed()
                self._life.raise_if_cut_off(generation, call, exc)
                self._fail()
                raise
            for stage in self._stages:
                stage.send_done(refit.result)
            self._life.refit_index += 1

    def _send(
        self, weights: Weights, context: RefitContext, notifier: RefitNotifier, cancel: threading.Event
    ) -> dict[Stream, RefitStats]:
        """One refit's transfer, on its refit thread: each stream's weights through every
        stage's ``send_stream``, then the pipeline; returns each stream's statistics."""
        assert self._plan is not None and self._sender is not None
        options: dict[str, Any] = {
            "bucket_size": self.bucket_size,
            "checksum": self._payload_checksum(),
            "direct": self._send_direct,
            "context": context,
            "notifier": notifier,
            "timeout_s": self.timeout_s,
            "cancel": cancel,
        }
        if isinstance(self._sender, Mapping):  # a stream per destination, each its own parts
            destinations = {
                rank: Destination(sender, functools.partial(self._stream_weights, Stream((rank,))))
                for rank, sender in self._sender.items()
            }
            per_destination = send_refit_each(weights, destinations, send=send_refit, **options)
            self.last_stats_by_destination = per_destination
            self.last_stats = RefitStats.combined(per_destination.values())
            return {Stream((rank,)): stats for rank, stats in per_destination.items()}
        (stream,) = self._plan.streams
        stats = RefitStats()
        weights = self._stream_weights(stream, weights, stats)
        self.last_stats = send_refit(weights, self._sender, record=self._packing_record, stats=stats, **options)
        return {stream: self.last_stats}

    def _stream_weights(self, stream: Stream, weights: Weights, stats: RefitStats) -> Weights:
        for stage in self._stages:
            weights = stage.send_stream(stream, weights, stats)
        return weights

    async def receive_weight_batches(
        self, *, owned: bool = False
    ) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Yield one refit's ``(name, tensor)`` batches, in the sender's order. Tensors own
        their memory: no transport buffer is aliased, though small host tensors (256 KiB at
        most) of one bucket may be views of one shared 1 MiB storage (over a transport that
        hands its slot's memory over, Gloo's, in the memory the bucket arrived in: keeping one
        keeps that memory); with ``borrow_received_tensors``, whole tensors of a bucket
        are views of the transport's buffer instead, valid until the next batch is asked for,
        unless ``owned`` asks for tensors that own their memory in this refit. Stopping early
        voids the refit (the engine must be re-initialized; the transport, and with it any lent
        buffer, is dropped then).

        Never blocks the event loop: the refit runs on a thread of its own (the engine's, kept
        from one refit to the next), advanced one batch per ``__anext__`` and idle while the
        consumer holds a batch, so it never runs ahead of the consumer (a lent buffer is
        refilled only once the next batch is asked for). Refit hooks fire on that thread. A
        consumer that does not ask for the next batch within ``timeout_s`` voids the refit (its
        sender would time out meanwhile): the next ``__anext__`` raises ``TransferTimeoutError``.
        When its tensors own their memory, once the last bucket has arrived the thread runs
        the rest of the refit at once and ends it there, handing over the last batch (or the
        last few, where a refit kind yields more at its end) with the refit done: the consumer
        may hold it as long as it likes, and the loop ends without another hand-off to the
        thread.

        Stopping early (``aclose()``, or cancelling the task awaiting ``__anext__``, whose
        transport wait in progress ends first, within ``timeout_s``) fails the engine, drops
        the transport (the sender fails at once with ``PeerLostError``, or within its
        ``timeout_s`` where the transport cannot tell), and joins the thread before the close
        or the ``CancelledError`` returns."""
        with self._receiving("receive_weight_batches()", owned) as refit:
            runner = self._refit_thread("rollout", cancel=refit.cancel, on_idle=refit.batches.close)
            try:
                while True:
                    taken = await runner.run(refit.step, ends=_Taken.ends)
                    for batch in taken.batches:
                        yield batch
                    if taken.finished():
                        break
                refit.completed = True
            finally:
                await runner.stop(cleanup=None if refit.completed else refit.batches.close)

    def receive_weight_batches_blocking(
        self, *, owned: bool = False
    ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """:meth:`receive_weight_batches` run on the calling thread: the same batches, rules and
        errors, as a plain generator that blocks while it waits for the next batch, without
        the hand-offs to and from the refit thread (about 0.2 ms each on a busy machine, two
        per batch). For callers that block anyway (a synchronous worker method: vLLM's). Refit
        hooks fire on the calling thread. It runs the same refit as ``receive_weight_batches``,
        not through it: a subclass that overrides one overrides both. Closing the generator
        early voids the refit, as stopping early does there; each transport wait is bounded by
        ``timeout_s``. Nothing here times the consumer between batches: one that holds a
        borrowed batch too long is timed out by its sender, which voids the refit, and the next
        batch raises what that brings (``RemoteRefitError`` or ``PeerLostError``).
        ``LifecycleError`` on a thread whose event loop is running."""
        refuse_running_loop("receive_weight_batches_blocking()", "async for over receive_weight_batches()")
        with self._receiving("receive_weight_batches_blocking()", owned) as refit:
            try:
                while True:
                    taken = refit.step()
                    yield from taken.batches
                    if taken.finished():
                        break
                refit.completed = True
            finally:
                if not refit.completed:
                    refit.batches.close()

    @contextlib.contextmanager
    def _receiving(self, call: str, owned: bool) -> Iterator[_Receive]:
        """One refit of this rollout rank around the code that steps it (``refit.step``, on
        whichever thread): the lifecycle's checks, and when the code is done, the stages'
        ends and refit numbering once ``refit.completed``, else the engine failed."""
        check_bool(call, "owned", owned)
        self._life.require(Phase.ROLLOUT, call)
        assert self._receiver is not None
        with self._life.refit_slot(call):
            notifier = RefitNotifier(self.backend_name, "rollout", self._life.rank)
            stats = RefitStats()
            generation = self._life.generation
            cancel = threading.Event()
            progress = ReceiveProgress()
            borrow = self.borrow_received_tensors and not owned
            batches = receive_refit(
                self._receiver,
                bucket_size=self.bucket_size,
                context=notifier.context(self._life.refit_index),
                notifier=notifier,
                timeout_s=self.timeout_s,
                checksum=self._payload_checksum(),
                merge_device=self._merge_device(),
                stats=stats,
                borrow=borrow,
                memo=self._receive_memo,
                cancel=cancel,
                progress=progress,
            )
            for stage in reversed(self._stages):  # the last to wrap the send unwraps first
                batches = stage.receive(batches, stats)
            # A lent buffer may be refilled once the next batch is asked for: never run ahead.
            refit = _Receive(batches, functools.partial(_take, batches, progress, finish_early=not borrow), cancel)
            try:
                try:
                    yield refit
                except Exception as exc:
                    self._life.raise_if_cut_off(generation, call, exc)
                    raise
            finally:
                if refit.completed:
                    for stage in self._stages:
                        stage.receive_done()
                    self.last_stats = stats
                    self._life.refit_index += 1
                else:
                    for stage in self._stages:
                        stage.receive_failed()
                    if generation == self._life.generation:
                        self._fail()


@dataclasses.dataclass
class _Send:
    """A policy rank's refit in :meth:`BucketedEngine._sending`: ``run(cancel)`` sends it."""

    run: Callable[[threading.Event], Any]
    result: Any = None
    """What ``run`` returned (each stream's statistics), for the stages' ends."""


@dataclasses.dataclass
class _Receive:
    """A rollout rank's refit in :meth:`BucketedEngine._receiving`: ``step()`` takes its next
    batches (:func:`_take`); the stepping code sets ``completed`` once it took the last."""

    batches: Generator[list[tuple[str, torch.Tensor]], None, None]
    step: Callable[[], _Taken]
    cancel: threading.Event
    completed: bool = False


def _last_step(_: object) -> bool:
    """A ``RefitThread.run`` ``ends`` for a refit's only step: it ends there."""
    return True


@dataclasses.dataclass
class _Taken:
    """What one step of a receive took from its batches (on the refit's thread)."""

    batches: list[list[tuple[str, torch.Tensor]]]
    last: bool
    """The refit's batches are all taken: it ended on its thread."""
    error: Exception | None = None
    """Raised by the refit after ``batches``, to be raised once they are handed over."""

    def ends(self) -> bool:
        return self.last

    def finished(self) -> bool:
        """Once its batches are handed over: raises the refit's error, else whether it ended."""
        if self.error is not None:
            raise self.error
        return self.last


def _take(
    batches: Generator[list[tuple[str, torch.Tensor]], None, None], progress: ReceiveProgress, *, finish_early: bool
) -> _Taken:
    """A receive's step: its next batch. Once the last bucket has arrived (``progress``) and
    with ``finish_early``, the rest of the refit too (the pipeline's and the stages' ends, which
    wait on no peer): its caller then takes the last batches and the end with no more
    hand-offs to this thread."""
    batch = next(batches, None)
    if batch is None:
        return _Taken([], last=True)
    if not (finish_early and progress.received_all):
        return _Taken([batch], last=False)
    taken = [batch]
    try:
        taken.extend(batches)
    except Exception as exc:  # noqa: BLE001 - raised by the caller after the batches before it
        return _Taken(taken, last=False, error=exc)
    return _Taken(taken, last=True)


def _drain(weights: Iterable[tuple[str, torch.Tensor]], cancel: threading.Event) -> None:
    """Run a policy rank's weights to their end, sending nothing (it has no receiver)."""
    for _ in weights:
        if cancel.is_set():
            raise RefitCancelled("the refit was cancelled by its caller")


BucketedEngine.options = BucketedEngine.options.extend(*stage_options("BucketedEngine", BucketedEngine.refit_stages))
document_options(BucketedEngine)
