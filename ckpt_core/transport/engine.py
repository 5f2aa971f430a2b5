"""``BucketedEngine``: the seed lifecycle over the shared pipeline, for transports to subclass.

A transport subclasses it and answers only how peers meet and how one buffer moves:

* ``_prepare_transport()`` -> extra JSON-compatible metadata for this worker (its address...);
* ``_connect_policy(...)`` -> a :class:`~ckpt_core._internal.bucket_io.BucketSender`, or ``None`` for a
  policy rank that has no receiver in the chosen topology (it drains its weights);
* ``_connect_rollout(...)`` -> a :class:`~ckpt_core._internal.bucket_io.BucketReceiver`;
* ``_release_transport()`` -> free what the three above acquired.

This class owns the rest: option and metadata validation, the lifecycle state machine (clear
``LifecycleError`` for out-of-order calls, one refit at a time), refit numbering, hooks and
statistics.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import functools
import textwrap
import threading
import uuid
from collections.abc import AsyncGenerator, Generator, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from ckpt_core._internal.agreement import AGREED_KEY, check_metadata_agreement
from ckpt_core._internal.bucket_io import BucketReceiver, BucketSender
from ckpt_core._internal.checksum import payload_checksum
from ckpt_core._internal.fanout import Destination, send_refit_each
from ckpt_core._internal.host_alloc import release_host_pool
from ckpt_core._internal.json_data import json_data_problem
from ckpt_core._internal.pipeline import Checksum, ReceiveMemo, RefitCancelled, receive_refit, send_refit
from ckpt_core._internal.replay import PackingRecord
from ckpt_core._internal.wire import FORMAT_VERSION
from ckpt_core.contract import CheckpointEngine
from ckpt_core.delta_refit import DeltaReceiver, DeltaState
from ckpt_core.errors import (
    EngineOptionError,
    InvalidArgumentError,
    LayoutUnavailableError,
    LifecycleError,
    WireFormatError,
)
from ckpt_core.hooks import RefitNotifier
from ckpt_core.layout import LayoutSelector, WeightLayout, check_layouts, is_ckpt_layout, select_weights
from ckpt_core.options import MAX_TIMEOUT_S, REQUIRED, Option, OptionSchema, OptionValues, check_count
from ckpt_core.quantize import QuantizationSpec, quantize_weights
from ckpt_core.stats import RefitStats, Role
from ckpt_core.topology import Topology
from ckpt_core.transport._refit_thread import RefitThread

BORROWS_KEY = "borrows_received_tensors"
"""In a rollout's ``prepare()`` metadata when it borrows: its senders then pack every chunk into
their bucket buffers (no direct chunks), since only bytes that arrived in a buffer can be lent."""


class _State(enum.Enum):
    NEW = "new (call prepare())"
    PREPARED = "prepared (call init_policy_process_group or init_rollout_process_group)"
    POLICY = "initialized as a policy worker"
    ROLLOUT = "initialized as a rollout worker"
    FAILED = "failed (a refit failed: call finalize(), then prepare() and init again)"


def _byte_bound(option: Option, owner: str, value: Any) -> int | None:
    """A bound in bytes: an ``int`` >= 0, or ``None`` for none."""
    return None if value is None else check_count(owner, option.name, value)


class BucketedEngine(CheckpointEngine):
    """Base of engines built on the shared bucket pipeline.

    Its options are declared once, in ``options`` (an :class:`~ckpt_core.options.OptionSchema`,
    listed at the end of this docstring): a subclass inherits them and assigns
    ``options = BucketedEngine.options.extend(...)`` (or ``.replace(...)``) to add or narrow its
    own; the constructor, written once here, parses every keyword through the class's schema
    (``EngineClass(bucket_size=..., **options)``, as NeMo RL builds engines) into
    ``self.option_values``, and an unknown name is an ``EngineOptionError`` naming the accepted
    options and the closest. ``checksum`` is off by default on every engine: turned on, each
    bucket carries a digest its receiver verifies (xxh3 on host buffers, the device checksum on
    GPU buffers), which catches corruption on the way (a bad NIC, DMA engine or memory) at the
    price of one more read of every byte on each side. What the options of NeMo RL's engines
    mean here (its config always passes the first):

    * ``release_after_refit`` (default off): NeMo RL then calls ``finalize()`` after every
      refit, and ``finalize()`` also hands cached memory back (the pooled host memory of freed
      received tensors, and, where the engine's buffers are on a GPU, torch's CUDA cache on
      that device), so that the memory is free for others until the next refit. ``finalize()``
      closes connections and drops bucket buffers either way; off, those caches stay warm for
      the next refit.
    * ``shard_expert_weights`` (default off): on a policy worker, ``get_target_weight_layout()``
      returns the ``"weight_layout"`` that the destination rollout worker put in its
      ``prepare()`` metadata (NeMo RL's vLLM worker does), for the caller to select the weights
      that destination keeps. On a rollout worker the engine only carries the flag: the
      worker's loader reads it. With a layout in this library's format (:mod:`ckpt_core.layout`,
      ``"format": "ckpt-engine.weight-layout"``), the engine selects instead: every rollout
      rank's layout is checked at init (bounds, overlaps, one model, nothing lost), the caller
      sends full weights, and each destination receives only the parts its layout keeps.

    And three of this library's:

    * ``quantize_for_rollout`` (default off): on a policy worker, each weight the destination
      names in its ``"weight_quantization"`` (:mod:`ckpt_core.quantize`; a rollout that serves
      FP8 publishes it in its ``prepare()`` metadata) is cast to the rollout's dtype and sent as
      FP8 bytes followed by its scale, made with the rollout's own arithmetic
      (:mod:`ckpt_core.fp8`), before layouts select (a layout then names the scales too). Every
      destination of one policy rank must hold the same quantization.
    * ``delta`` (default off): each weight travels as a patch of the elements whose bits
      changed since the last refit its destination completed, where that is fewer bytes than
      the whole weight and not predicted slower by the sender's model of its own refit times
      (:mod:`ckpt_core.delta_refit`, :mod:`ckpt_core.delta_choice`; after quantizing and
      layouts: patches of what each destination keeps); the receiver hands out whole weights.
      Each side keeps a copy of each weight sent so (kept across ``finalize()``): a rollout
      reports the version it holds in its ``prepare()`` metadata, and a sender whose
      destination holds another (a restarted rollout, a failed refit) sends every weight whole.
      ``delta_max_baseline_bytes`` bounds the copies per destination stream: weights past it
      (in the order sent) travel whole, and neither side keeps a copy of them.
    * ``borrow_received_tensors`` (default off): a tensor that arrived whole inside one bucket
      is handed out as a view of the transport's bucket buffer instead of a copy (tensors that
      spanned buckets or move to ``merge_device`` stay copies; the rollout says in its
      ``prepare()`` metadata that it borrows, and its senders then pack every chunk into their
      buckets instead of sending large ones as direct chunks, which would land in fresh memory). A
      borrowed tensor, and every view made from it, is valid only until the caller asks for
      the next batch (or the generator is closed): the buffer is then refilled with later
      bytes, which the tensor will show. Borrowed tensors are read-only: the buffer may be
      mapped read-only (cuda_ipc's host slots: a write faults the process) or shared with other
      rollouts of one broadcast (a write changes what they read). For a loader that copies each
      batch into its model at once and keeps nothing; anything kept must be ``clone()``d first.

    What a subclass provides (the rest is this class's and the pipeline's):

    * ``backend_name``: its entry-point name, required of every concrete subclass;
    * ``_connect_policy`` and ``_connect_rollout`` (abstract): a sender / receiver;
    * ``options``, where it has options of its own (a ``topology`` option, of type
      :class:`~ckpt_core.topology.Topology`, sets who sends to whom; without one, policy rank
      0 feeds every rollout rank);
    * optionally ``_prepare_transport``, ``_release_transport``, ``_release_cached_memory``,
      ``_destinations``, ``_payload_checksum``, ``_merge_device`` and ``_agreed_settings``.

    Every other underscore name is private to this class.
    """

    options: ClassVar[OptionSchema] = OptionSchema(
        Option.size(
            "bucket_size",
            REQUIRED,
            "bytes per bucket; each side holds two buffers of it",
            agreed=True,
            argument="bucket_size_bytes",
        ),
        Option.number(
            "timeout_s",
            300.0,
            "bound on every wait (rendezvous, each header, each payload)",
            maximum=MAX_TIMEOUT_S,
            kind="seconds > 0, at most 30 days",
        ),
        Option.flag(
            "checksum",
            False,
            "a digest per bucket, verified on receipt (IntegrityError on mismatch): xxh3 on host "
            "buffers, the device checksum on GPU buffers; off by default",
            agreed=True,
        ),
        Option.flag(
            "release_after_refit",
            False,
            "NeMo RL's: finalize() also hands cached memory back (the host pool of freed received "
            "tensors; torch's CUDA cache where buffers are on a GPU)",
        ),
        Option.flag(
            "shard_expert_weights",
            False,
            "NeMo RL's: get_target_weight_layout() returns the destination's weight_layout; with "
            "ckpt-engine layouts each destination receives only its parts",
            agreed=True,
        ),
        Option.flag(
            "quantize_for_rollout",
            False,
            "policy side: each weight the rollout's 'weight_quantization' names is sent as FP8 bytes "
            "and scales made with the rollout's own arithmetic (ckpt_core.quantize)",
            agreed=True,
        ),
        Option.flag(
            "delta",
            False,
            "each weight is sent as a patch of the elements that changed since the refit its "
            "destination last completed, where that is fewer bytes and not predicted slower "
            "(docs/delta.md); both sides keep a copy of each weight sent so",
            agreed=True,
        ),
        Option.custom(
            "delta_max_baseline_bytes",
            None,
            "policy side, with delta: the most bytes of copies kept per destination stream (by "
            "each side); weights past it, in the order sent, always travel whole and uncopied",
            parse=_byte_bound,
            kind="int >= 0 (bytes) or None: no bound",
        ),
        Option.flag(
            "borrow_received_tensors",
            False,
            "rollout side: whole tensors arrive as views of the bucket buffer (no copy), valid "
            "until the next batch is asked for",
        ),
    )
    """Every option of this engine class, declared once (see the class docstring)."""

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
        _document_options(cls)

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
        self.quantize_for_rollout: bool = values.quantize_for_rollout
        self.delta: bool = values.delta
        if values.delta_max_baseline_bytes is not None and not self.delta:
            raise EngineOptionError(
                f"{type(self).__name__}: delta_max_baseline_bytes bounds delta refits' copies; it needs delta=True"
            )
        # With delta: the baselines, kept across finalize() (they are the option's point).
        self._delta: DeltaState | None = (
            DeltaState(
                max_baseline_bytes=values.delta_max_baseline_bytes,
                # Received tensors own their memory unless lent: a weight received whole is kept as it is.
                keeps_received=not values.borrow_received_tensors,
            )
            if self.delta
            else None
        )
        # With quantize_for_rollout: what the destinations hold quantized, and how messages name them.
        self._quantization: tuple[QuantizationSpec, str] | None = None
        self._target_layout: dict[str, Any] | None = None
        self._send_direct = True  # False once a rollout this policy serves borrows (init)
        # With ckpt-engine layouts: destination rollout rank -> (its layout, how messages name it).
        self._selection: dict[int, tuple[WeightLayout, str]] = {}
        self.last_stats_by_destination: dict[int, RefitStats] = {}
        """With a stream per destination: each destination's statistics of the last refit."""
        self._state = _State.NEW
        self._engine_id = ""
        self._sender: BucketSender | Mapping[int, BucketSender] | None = None
        self._receiver: BucketReceiver | None = None
        # What the last refit sent and received, replayed where the next one repeats it. Kept
        # across finalize() (NeMo RL finalizes after every refit with release_after_refit):
        # a record is replayed only under the settings it was made with, and a receiver reuses
        # a decoding only for a byte-equal chunk list.
        self._packing_record = PackingRecord()
        self._receive_memo = ReceiveMemo()
        self._rank = -1
        self._refit_index = 0
        self._busy = False
        self._generation = 0  # counts finalize() calls: a refit outliving one was cut off
        self.last_stats: RefitStats | None = None
        """Statistics of this worker's last completed refit."""

    # --- what transports implement ---------------------------------------------------

    def _prepare_transport(self) -> dict[str, Any]:
        """What peers need to reach this worker, as JSON data (its role is not known yet)."""
        return {}

    @abc.abstractmethod
    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | Mapping[int, BucketSender] | None:
        """Connect to this policy rank's receivers within ``timeout_s``; ``None`` for a rank
        that sends to no one (its weights are drained at every refit). Where
        ``_separate_streams()`` says so: a sender per destination rollout rank, each then sent
        a stream of its own (with ckpt-engine layouts, its own parts)."""

    @abc.abstractmethod
    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        """Connect to this rollout rank's sender within ``timeout_s``."""

    def _release_transport(self) -> None:
        """Free what ``_prepare_transport`` and the ``_connect`` methods acquired. Idempotent:
        it runs after failures, and before ``prepare()`` ever ran."""

    def _release_cached_memory(self) -> None:
        """Hand cached memory back to the system (``finalize()`` with ``release_after_refit``);
        engines with device buffers also empty their device's cache."""
        release_host_pool()

    def _separate_streams(self) -> bool:
        """Whether ``_connect_policy`` returns a sender per destination rollout rank (a mapping),
        so that each destination can be sent a stream of its own: as the topology says
        (``fanout``); otherwise one sender."""
        return self._topology().separate_streams

    def _destinations(self, worker_rank: int, train_world_size: int, rollout_world_size: int) -> list[int]:
        """The rollout ranks policy rank ``worker_rank`` sends to, as the engine's topology
        says (:meth:`_topology`)."""
        return self._topology().destinations(worker_rank, train_world_size, rollout_world_size)

    def _topology(self) -> Topology:
        """Who sends to whom: the ``topology`` option where the engine has one, else
        ``Topology.BROADCAST`` (policy rank 0 feeds every rollout rank)."""
        value = self.option_values.get("topology", Topology.BROADCAST)
        return value if isinstance(value, Topology) else Topology.parse(value, owner=type(self).__name__)

    def _payload_checksum(self) -> Checksum | None:
        """The checksum both sides compute over a bucket's payload, or ``None`` for none.
        Transports with device buffers return a function that reads device memory."""
        return payload_checksum if self.checksum else None

    def _merge_device(self) -> torch.device | str | None:
        """Where received tensors are built; ``None``: on the receiver's buffer device."""
        return None

    def _agreed_settings(self) -> dict[str, Any]:
        """Settings every worker of this engine must share (plain JSON values), compared with
        every peer's at init (:mod:`ckpt_core._internal.agreement`): the options the schema
        declares ``agreed`` (``shard_expert_weights`` is one: a rollout that publishes its
        layout and a policy that ignores it would send whole weights to a rank that expects
        its shards). A transport overrides it only for settings that are not options."""
        return type(self).options.agreed(self.option_values)

    # --- the seed lifecycle ------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        self._require(_State.NEW, "prepare()")
        self._engine_id = uuid.uuid4().hex
        metadata = {"backend": self.backend_name, "format": FORMAT_VERSION, "engine_id": self._engine_id}
        metadata[AGREED_KEY] = self._agreed_settings()
        if self.borrow_received_tensors:  # as a rollout: senders then pack every byte (see init)
            metadata[BORROWS_KEY] = True
        if self._delta is not None:  # as a rollout: the version its senders' patches must be made against
            metadata.update(self._delta.metadata())
        transport = self._prepare_transport()
        clash = sorted(set(transport) & set(metadata))
        if clash:
            raise WireFormatError(
                f"{type(self).__name__}._prepare_transport() returned the keys {clash}, which the "
                f"engine's own metadata uses ({sorted(metadata)}): name the transport's keys otherwise"
            )
        metadata.update(transport)
        self._state = _State.PREPARED
        return metadata

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self._require(_State.PREPARED, "init_policy_process_group()")
        checked = self._check_metadata(worker_rank, worker_rank, train_world_size, rollout_world_size, metadata)
        layout = self._destination_layout(worker_rank, train_world_size, rollout_world_size, checked)
        self._quantization = self._destination_quantization(worker_rank, train_world_size, rollout_world_size, checked)
        if self._delta is not None:
            self._connect_delta(worker_rank, train_world_size, rollout_world_size, checked)
        self._sender = self._connect_policy(worker_rank, train_world_size, rollout_world_size, checked)
        if self._delta is not None:
            connected = self._sender
            senders = list(connected.values()) if isinstance(connected, Mapping) else [connected] if connected else []
            self._delta.warm_up([sender.buffer(0).device for sender in senders])
        self._target_layout = layout
        # A rollout that borrows can lend only bytes that arrived in its buffers: a direct
        # chunk would land in fresh memory it then owns (allocated, faulted in) instead.
        self._send_direct = not any(entry.get(BORROWS_KEY) for entry in checked[train_world_size:])
        self._enter(_State.POLICY, worker_rank)

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self._require(_State.PREPARED, "init_rollout_process_group()")
        own_index = train_world_size + rollout_rank if _is_int(train_world_size) else -1
        checked = self._check_metadata(
            rollout_rank, own_index, train_world_size, rollout_world_size, metadata, role="rollout"
        )
        self._receiver = self._connect_rollout(rollout_rank, train_world_size, rollout_world_size, checked)
        if self._delta is not None:
            self._delta.warm_up([self._receiver.buffer(0).device])
        self._enter(_State.ROLLOUT, rollout_rank)

    def finalize(self) -> None:
        """Release buffers, connections and groups; with ``release_after_refit``, also the
        cached memory (see the class docstring). Idempotent; ``prepare()`` may follow."""
        try:
            self._drop_transport()
        finally:
            self._state = _State.NEW
            self._refit_index = 0
            self._busy = False
            self._target_layout = None
            self._selection = {}
            self._quantization = None
            self._generation += 1
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
        return self._delta.baseline_bytes if self._delta is not None else 0

    def get_target_weight_layout(self) -> dict[str, Any] | None:
        """With ``shard_expert_weights``: the ``"weight_layout"`` of the rollout worker this
        policy worker sends to (``None`` for a policy worker that sends to none and drains its
        weights); where it sends each of several rollout ranks a stream of its own and their
        ckpt-engine layouts differ (topology ``"fanout"``), ``{"<rollout rank>": layout}``.
        Without it: ``None``. ``LayoutUnavailableError`` before ``init_policy_process_group``,
        which is where the layout arrives."""
        if not self.shard_expert_weights:
            return None
        if self._state is not _State.POLICY:
            raise LayoutUnavailableError(
                f"{type(self).__name__}.get_target_weight_layout(): the layout comes with the rollout "
                f"workers' metadata in init_policy_process_group(), but the engine is {self._state.value}"
            )
        return self._target_layout

    def _destination_layout(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """The layout ``get_target_weight_layout()`` returns, checked before connecting; with a
        ckpt-engine layout (:mod:`ckpt_core.layout`), also what ``send_weights`` selects by."""
        self._selection = {}
        if not self.shard_expert_weights:
            return None
        owner = type(self).__name__
        destinations = self._destinations(worker_rank, train_world_size, rollout_world_size)
        layouts = []
        for rank in destinations:
            layout = metadata[train_world_size + rank].get("weight_layout")
            if not isinstance(layout, dict):
                raise InvalidArgumentError(
                    f"{owner}: shard_expert_weights=True, but rollout rank {rank}'s prepare() metadata has no "
                    f"'weight_layout' mapping (got {type(layout).__name__}): each rollout worker adds its "
                    "layout to its metadata, as NeMo RL's vLLM worker does when its engine has "
                    "shard_expert_weights=True; or turn shard_expert_weights off on every worker"
                )
            layouts.append(layout)
        differ = any(layout != layouts[0] for layout in layouts[1:])
        ckpt_format = bool(layouts) and is_ckpt_layout(layouts[0])
        if differ and not (ckpt_format and self._separate_streams()):
            raise EngineOptionError(
                f"{owner}: policy rank {worker_rank} sends the same bytes to rollout ranks {destinations}, "
                "but their weight layouts differ, so no one selection of weights fits them all: use a "
                "topology in which each policy rank feeds one rollout rank (topology='paired'), one that "
                "sends each rollout rank a stream of its own with ckpt-engine layouts (topology='fanout'), "
                "or shard_expert_weights=False"
            )
        if ckpt_format:
            parsed = self._checked_layouts(train_world_size, rollout_world_size, metadata)
            if self._separate_streams():
                self._selection = {rank: (parsed[rank], f"rollout rank {rank}") for rank in destinations}
            else:  # one stream for every destination: their layouts are equal
                label = f"rollout rank {destinations[0]}" if len(destinations) == 1 else f"rollout ranks {destinations}"
                self._selection = {destinations[0]: (parsed[destinations[0]], label)}
        if differ:  # several destinations, each with its own layout
            return {str(rank): layout for rank, layout in zip(destinations, layouts)}
        return layouts[0] if layouts else None

    def _destination_quantization(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[QuantizationSpec, str] | None:
        """With ``quantize_for_rollout``: the ``"weight_quantization"`` of the rollout ranks this
        policy rank sends to, which must be one (the weights are quantized once, before any
        stream of its own), checked before connecting."""
        if not self.quantize_for_rollout:
            return None
        owner = type(self).__name__
        destinations = self._destinations(worker_rank, train_world_size, rollout_world_size)
        if not destinations:
            return None
        specs = []
        for rank in destinations:
            spec = metadata[train_world_size + rank].get("weight_quantization")
            if spec is None:
                raise InvalidArgumentError(
                    f"{owner}: quantize_for_rollout=True, but rollout rank {rank}'s prepare() metadata has no "
                    "'weight_quantization' (ckpt_core.quantize): a rollout that holds weights quantized adds it; "
                    "for one that does not, turn quantize_for_rollout off on every worker"
                )
            specs.append(QuantizationSpec.from_json(spec, owner=f"{owner}: rollout rank {rank}'s weight_quantization"))
        if any(spec != specs[0] for spec in specs[1:]):
            raise EngineOptionError(
                f"{owner}: policy rank {worker_rank} quantizes its weights once for rollout ranks {destinations}, "
                "but their weight quantizations differ: serve them from policy ranks of their own"
            )
        label = f"rollout rank {destinations[0]}" if len(destinations) == 1 else f"rollout ranks {destinations}"
        return specs[0], label

    def _connect_delta(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> None:
        """With ``delta``: this init's destination streams, each keeping its baseline only where
        every destination reports holding it (:meth:`DeltaState.connect`)."""
        assert self._delta is not None
        destinations = self._destinations(worker_rank, train_world_size, rollout_world_size)
        streams: dict[tuple[int, ...], str] = {}
        if self._separate_streams():
            streams = {(rank,): f"rollout rank {rank}" for rank in destinations}
        elif destinations:
            label = f"rollout rank {destinations[0]}" if len(destinations) == 1 else f"rollout ranks {destinations}"
            streams = {tuple(destinations): label}
        reported = {rank: metadata[train_world_size + rank].get(DeltaState.METADATA_KEY) for rank in destinations}
        self._delta.connect(streams, reported)

    def _checked_layouts(
        self, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> dict[int, WeightLayout]:
        """Every rollout rank's ckpt-engine layout, checked together: each one alone, then that
        they describe one model and lose nothing."""
        owner = type(self).__name__
        parsed = {}
        for rank in range(rollout_world_size):
            layout = metadata[train_world_size + rank].get("weight_layout")
            parsed[rank] = WeightLayout.from_json(layout, owner=f"{owner}: rollout rank {rank}'s weight_layout")
        check_layouts(parsed, owner=owner)
        return parsed

    def _destination_streams(self, senders: Mapping[int, BucketSender]) -> dict[int, Destination]:
        """One stream per destination sender, each selecting by its destination's layout."""
        streams = {}
        for rank, sender in senders.items():
            chosen = self._selection.get(rank)
            encode = self._delta.senders[(rank,)].encode if self._delta is not None else None
            if chosen is None:
                streams[rank] = Destination(sender, lambda name, tensor: tensor, encode=encode)
            else:
                selector = LayoutSelector(chosen[0], destination=chosen[1])
                streams[rank] = Destination(sender, selector.select, selector.finish, encode=encode)
        return streams

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
        self._state = _State.FAILED
        try:
            self._drop_transport()
        except Exception:  # noqa: BLE001 - the refit's own error is what the caller needs
            pass

    def _raise_if_cut_off(self, generation: int, call: str, exc: BaseException) -> None:
        """A refit raised ``exc``: if ``finalize()`` ran meanwhile (from the weights generator,
        the loader or another thread), its torn-down transport is the cause, so the caller gets
        a ``LifecycleError`` and the engine stays finalized."""
        if generation != self._generation and isinstance(exc, Exception):
            raise LifecycleError(
                f"{type(self).__name__}.{call}: finalize() was called during this refit, which "
                "voids it; finalize only after the refit's call returned or raised"
            ) from exc

    def _refit_thread(self, role: Role, **kwargs: Any) -> RefitThread:
        """The thread one refit of this engine runs on (see :mod:`ckpt_core.transport._refit_thread`):
        it waits at most ``timeout_s`` for its next step; stopping it (a cancelled refit: the
        step in flight may finish a transport wait, then abort, each wait bounded by
        ``timeout_s``) is bounded by ``4 * timeout_s`` plus a margin."""
        name = f"ckpt-refit-{self.backend_name}-{role}-{self._rank}"
        return RefitThread(name, idle_s=self.timeout_s, stop_s=4 * self.timeout_s + 10.0, **kwargs)

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """Send one refit. Never blocks the event loop: the transfer runs on a thread of its
        own (one per refit, ended before this returns), and the coroutine awaits it. The
        weights generator is iterated on that thread, with the CUDA device and stream current
        where this was called (when CUDA is initialized); refit hooks fire there too. A policy
        rank without a receiver drains ``weights`` there (its iterator may run collectives
        with the ranks that do send). Errors are raised here with their own types.

        Cancelling the task awaiting this voids the refit: the transfer stops before its next
        weight or bucket (a transport wait in progress ends first, within ``timeout_s``), the
        receivers are sent an abort (they fail with ``RemoteRefitError``), the thread is
        joined, and the engine is failed (``finalize()``, then ``prepare()`` and init again)
        before ``CancelledError`` is raised.

        A yielded tensor must keep its memory and bytes while the sender may still read it:
        small ones are copied before the next weight is asked for; a chunk sent direct (1 MiB
        or more, on transports that take them) is read until the weights yielded after it hold
        more than two buckets' bytes. A generator that frees or refills a weight sooner yields
        a copy of it (docs/reliability.md, "The weights generator"); a weight found freed is an
        ``UnsupportedTensorError``."""
        self._require(_State.POLICY, "send_weights()")
        with self._refit_slot("send_weights()"):
            if self._sender is None:
                drainer = self._refit_thread("policy")
                try:
                    await drainer.run(functools.partial(_drain, weights, drainer.cancel))
                finally:
                    await drainer.stop()
                self._refit_index += 1
                return
            notifier = RefitNotifier(self.backend_name, "policy", self._rank)
            generation = self._generation
            options: dict[str, Any] = {
                "bucket_size": self.bucket_size,
                "checksum": self._payload_checksum(),
                "direct": self._send_direct,
            }
            context = notifier.context(self._refit_index)
            self.last_stats_by_destination = {}
            if self._quantization is not None:  # before layouts select: scales follow their weights
                spec, label = self._quantization
                weights = quantize_weights(weights, spec, destination=label)
            runner = self._refit_thread("policy")
            try:
                try:
                    if isinstance(self._sender, Mapping):  # a stream per destination, each its own part
                        send = functools.partial(
                            send_refit_each,
                            weights,
                            self._destination_streams(self._sender),
                            send=send_refit,
                            context=context,
                            notifier=notifier,
                            timeout_s=self.timeout_s,
                            cancel=runner.cancel,
                            **options,
                        )
                        per_destination = await runner.run(send)
                        self.last_stats_by_destination = per_destination
                        self.last_stats = RefitStats.combined(per_destination.values())
                    else:
                        if self._selection:
                            layout, destination = next(iter(self._selection.values()))
                            weights = select_weights(weights, layout, destination=destination)
                        stats = RefitStats()
                        if self._delta is not None:  # after layouts: patches of what the destination keeps
                            (delta,) = self._delta.senders.values()
                            weights = delta.encode(weights, stats)
                        self.last_stats = await runner.run(
                            functools.partial(
                                send_refit,
                                weights,
                                self._sender,
                                context=context,
                                notifier=notifier,
                                timeout_s=self.timeout_s,
                                record=self._packing_record,
                                cancel=runner.cancel,
                                stats=stats,
                                **options,
                            )
                        )
                finally:
                    await runner.stop()  # the transport is never dropped under a running step
            except BaseException as exc:
                if self._delta is not None:
                    self._delta.discard_senders()
                self._raise_if_cut_off(generation, "send_weights()", exc)
                self._fail()
                raise
            if self._delta is not None:
                per_stream: dict[tuple[int, ...], RefitStats] = {
                    (rank,): stats for rank, stats in self.last_stats_by_destination.items()
                }
                if not per_stream and self.last_stats is not None:  # one stream: its senders' ranks
                    per_stream = {ranks: self.last_stats for ranks in self._delta.senders}
                self._delta.commit_senders(per_stream)
            self._refit_index += 1

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Yield one refit's ``(name, tensor)`` batches, in the sender's order. Tensors own
        their memory: no transport buffer is aliased, though small host tensors (256 KiB at
        most) of one bucket may be views of one shared 1 MiB storage; with
        ``borrow_received_tensors``, whole tensors of a bucket are views of the transport's
        buffer instead, valid until the next batch is asked for. Stopping early voids the refit
        (the engine must be re-initialized; the transport, and with it any lent buffer, is
        dropped then).

        Never blocks the event loop: the refit runs on a thread of its own (one per refit),
        advanced one batch per ``__anext__`` and idle while the consumer holds a batch, so it
        never runs ahead of the consumer (a lent buffer is refilled only once the next batch
        is asked for). Refit hooks fire on that thread. A consumer that does not ask for the
        next batch within ``timeout_s`` voids the refit (its sender would time out meanwhile):
        the next ``__anext__`` raises ``TransferTimeoutError``.

        Stopping early (``aclose()``, or cancelling the task awaiting ``__anext__``, whose
        transport wait in progress ends first, within ``timeout_s``) fails the engine, drops
        the transport (the sender fails at once with ``PeerLostError``, or within its
        ``timeout_s`` where the transport cannot tell), and joins the thread before the close
        or the ``CancelledError`` returns."""
        self._require(_State.ROLLOUT, "receive_weight_batches()")
        assert self._receiver is not None
        with self._refit_slot("receive_weight_batches()"):
            notifier = RefitNotifier(self.backend_name, "rollout", self._rank)
            stats = RefitStats()
            completed = False
            generation = self._generation
            cancel = threading.Event()
            batches = receive_refit(
                self._receiver,
                bucket_size=self.bucket_size,
                context=notifier.context(self._refit_index),
                notifier=notifier,
                timeout_s=self.timeout_s,
                checksum=self._payload_checksum(),
                merge_device=self._merge_device(),
                stats=stats,
                borrow=self.borrow_received_tensors,
                memo=self._receive_memo,
                cancel=cancel,
            )
            if self._delta is not None:
                batches = _decoded(batches, self._delta.receiver, stats)
            runner = self._refit_thread("rollout", cancel=cancel, on_idle=batches.close)
            step = functools.partial(next, batches, None)
            try:
                try:
                    while (batch := await runner.run(step)) is not None:
                        yield batch
                    completed = True
                finally:
                    await runner.stop(cleanup=None if completed else batches.close)
            except Exception as exc:
                self._raise_if_cut_off(generation, "receive_weight_batches()", exc)
                raise
            finally:
                if completed:
                    if self._delta is not None:
                        self._delta.receiver.commit()
                    self.last_stats = stats
                    self._refit_index += 1
                else:
                    if self._delta is not None:
                        self._delta.receiver.discard()
                    if generation == self._generation:
                        self._fail()

    # --- checks ------------------------------------------------------------------------

    def _require(self, state: _State, call: str) -> None:
        if self._state is not state:
            raise LifecycleError(
                f"{type(self).__name__}.{call} needs the engine to be {state.name.lower()}, but it "
                f"is {self._state.value}"
            )

    def _enter(self, state: _State, rank: int) -> None:
        self._state = state
        self._rank = rank
        self._refit_index = 0

    @contextlib.contextmanager
    def _refit_slot(self, call: str) -> Iterator[None]:
        """Holds the engine's one refit slot; a second concurrent refit is refused."""
        if self._busy:
            raise LifecycleError(
                f"{type(self).__name__}.{call}: a refit is already in progress on this engine; "
                "await it before starting another"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def _check_metadata(
        self,
        rank: int,
        own_index: int,
        train_world_size: int,
        rollout_world_size: int,
        metadata: Any,
        role: Role = "policy",
    ) -> list[dict[str, Any]]:
        owner = type(self).__name__
        for label, value in (("train_world_size", train_world_size), ("rollout_world_size", rollout_world_size)):
            if not _is_int(value) or value < 1:
                raise InvalidArgumentError(f"{owner}: {label} must be an int >= 1, got {value!r}")
        size = train_world_size if role == "policy" else rollout_world_size
        label = "worker_rank" if role == "policy" else "rollout_rank"
        if not _is_int(rank) or not 0 <= rank < size:
            raise InvalidArgumentError(f"{owner}: {label} must be an int in [0, {size}), got {rank!r}")
        expected = train_world_size + rollout_world_size
        if not isinstance(metadata, list) or len(metadata) != expected:
            got = len(metadata) if isinstance(metadata, list) else type(metadata).__name__
            raise InvalidArgumentError(
                f"{owner}: metadata must be a list of {expected} prepare() results "
                f"({train_world_size} policy entries, then {rollout_world_size} rollout entries), got {got}"
            )
        for index, entry in enumerate(metadata):
            if not isinstance(entry, dict):
                raise WireFormatError(
                    f"{owner}: metadata[{index}] is a {type(entry).__name__}, not a mapping: pass each "
                    "worker's prepare() result unchanged"
                )
            problem = json_data_problem(entry)
            if problem is not None:
                raise WireFormatError(
                    f"{owner}: metadata[{index}] is not plain JSON data: {problem}; pass each worker's "
                    "prepare() result unchanged (as JSON, if your orchestrator serializes it)"
                )
            if entry.get("backend") != self.backend_name:
                found = entry.get("backend")
                raise WireFormatError(
                    f"{owner}: metadata[{index}] comes from backend {found!r}, not "
                    f"{self.backend_name!r}: every worker must use the same backend"
                )
            if entry.get("format") != FORMAT_VERSION:
                raise WireFormatError(
                    f"{owner}: metadata[{index}] has format {entry.get('format')!r}, this side speaks "
                    f"{FORMAT_VERSION}: install the same ckpt-core version on every worker"
                )
        if metadata[own_index].get("engine_id") != self._engine_id:
            raise InvalidArgumentError(
                f"{owner}: metadata[{own_index}] is not this engine's prepare() result: order the "
                "list as policy entries by worker_rank, then rollout entries by rollout_rank"
            )
        check_metadata_agreement(
            owner, self._agreed_settings(), metadata, train_world_size, spellings=type(self).options.spellings()
        )
        return metadata


def _document_options(cls: type[Any]) -> None:
    """Append the options ``cls`` takes, generated from its schema, to its docstring (so
    ``help()`` and API docs list exactly what the constructor accepts)."""
    doc = cls.__dict__.get("__doc__") or ""
    marker = "Options (generated from"
    if marker in doc:
        doc = doc[: doc.index(marker)]
    doc = doc.rstrip()
    body = [line for line in doc.splitlines()[1:] if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in body), default=0)
    generated = textwrap.indent(cls.options.docstring(), " " * indent)
    cls.__doc__ = f"{doc}\n\n{generated}\n" if doc else generated


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decoded(
    batches: Generator[list[tuple[str, torch.Tensor]], None, None], receiver: DeltaReceiver, stats: RefitStats
) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
    """``batches`` of a delta refit as whole weights (the manifest dropped, patches applied,
    counted into ``stats``); closing this closes ``batches``."""
    try:
        for batch in batches:
            decoded = [entry for entry in (receiver.receive(name, tensor, stats) for name, tensor in batch) if entry]
            if decoded:
                yield decoded
        receiver.end()
    finally:
        batches.close()


def _drain(weights: Iterable[tuple[str, torch.Tensor]], cancel: threading.Event) -> None:
    """Run a policy rank's weights to their end, sending nothing (it has no receiver)."""
    for _ in weights:
        if cancel.is_set():
            raise RefitCancelled("the refit was cancelled by its caller")


_document_options(BucketedEngine)
