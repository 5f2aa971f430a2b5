"""``MyTransportEngine``: <how peers meet, how one buffer moves, in two sentences>.

A transport built on ``BucketedEngine`` answers two questions only; the core owns packing,
headers, checksums, double buffering, reassembly, lifecycle checks, hooks and statistics. Fill
in the four ``_`` methods of the engine and the two classes below (marked TODO), then run the
conformance kit: ``pytest tests``. Those four are hooks of
``ckpt_core.transport.TransportHooks``, which lists every engine method a transport may override
(``TRANSPORT_HOOKS``); the others have defaults that fit a host-memory transport, and every
other underscore name is the core's. docs/writing-a-transport.md in ckpt-engine explains each
guarantee; examples/tcp_transport there is a complete transport built from this template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ckpt_core.transport import BackendCapabilities, BucketedEngine, BucketReceiver, BucketSender, Option


class MySender(BucketSender):
    """Policy side. Owns ``num_slots`` buffers of ``bucket_size`` bytes, allocated once."""

    def __init__(self, bucket_size: int) -> None:
        self._buffers = [torch.empty(bucket_size, dtype=torch.uint8) for _ in range(self.num_slots)]

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        # TODO: start moving `header` and buffer(slot)[:nbytes] to every receiver of this
        # sender, headers in posting order. Raise PeerLostError / TransferTimeoutError.
        # (`direct` is only ever non-empty if you set `direct_chunks = True` on both sides:
        # then send each of them after the slot's bytes, keeping references until
        # wait_slot(slot); the receiver gets their destinations in post_payload.)
        raise NotImplementedError("MySender.post: move one bucket (see the TODO)")

    def wait_slot(self, slot: int, timeout_s: float) -> None:
        # TODO: block (at most timeout_s) until buffer(slot) may be overwritten.
        raise NotImplementedError("MySender.wait_slot: wait for a slot's last post (see the TODO)")

    def close(self) -> None:
        # TODO: release connections too. Must be idempotent.
        self._buffers = []


class MyReceiver(BucketReceiver):
    """Rollout side. Owns ``num_slots`` buffers of ``bucket_size`` bytes, allocated once."""

    def __init__(self, bucket_size: int) -> None:
        self._buffers = [torch.empty(bucket_size, dtype=torch.uint8) for _ in range(self.num_slots)]

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def recv_header(self, timeout_s: float) -> bytes:
        # TODO: block (at most timeout_s) for the next header's bytes.
        raise NotImplementedError("MyReceiver.recv_header (see the TODO)")

    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        # TODO: start receiving the last header's payload into buffer(slot)[:nbytes]
        # (and each direct chunk into its tensor in `direct`, if you set `direct_chunks`).
        raise NotImplementedError("MyReceiver.post_payload (see the TODO)")

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        # TODO: block (at most timeout_s) until buffer(slot) holds the whole payload.
        raise NotImplementedError("MyReceiver.wait_payload (see the TODO)")

    def close(self) -> None:
        # TODO: release connections too. Must be idempotent.
        self._buffers = []


class MyTransportEngine(BucketedEngine):
    """Takes ``BucketedEngine``'s options (``bucket_size``, ``timeout_s``, ``checksum``, NeMo
    RL's ``release_after_refit`` and ``shard_expert_weights``, ``borrow_received_tensors``, and
    those of the refit kinds every engine runs: ``quantize_for_rollout``, ``delta``) plus its
    own, declared once in ``options`` below; the generated list of all of them is appended to
    this docstring.

    Declare each option of your own there (``Option.flag``, ``.number``, ``.size``, ``.choice``,
    ``.text`` or ``.custom`` with a ``parse`` function raising ``EngineOptionError``), never as
    ``__init__`` arguments: ckpt-core's constructor parses every keyword through the schema,
    and the registry, ``ckpt-engine list``, the Ray launcher and the conformance kit read it.
    Mark ``agreed=True`` what every worker must set alike (it is compared at init).
    """

    backend_name: ClassVar[str] = "my_transport"  # the entry-point name; stamped into metadata
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu",), topologies=("broadcast",), placements=("colocated",)
    )

    # TODO: your options (or delete this to take only BucketedEngine's). Narrow an inherited
    # one with .replace("timeout_s", default=60.0).
    options = BucketedEngine.options.extend(
        Option.number("connect_timeout_s", 30.0, "bound on connecting to the peers at init"),
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)  # every option parsed through `options`
        # Read parsed values from self.option_values; keep your own state here.
        self.connect_timeout_s: float = self.option_values.connect_timeout_s

    def _prepare_transport(self) -> dict[str, Any]:
        # TODO: open what peers need to reach this worker (its role is not known yet) and
        # return it as plain JSON data (str, int, float, bool, None, lists, str-keyed dicts).
        raise NotImplementedError("MyTransportEngine._prepare_transport: advertise this worker (see the TODO)")

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | None:
        # TODO: connect to this rank's receivers (metadata: policy entries by rank, then rollout
        # entries by rank) within timeout_s, and return MySender; or None for a rank that has
        # no receiver (the core then drains its weights).
        raise NotImplementedError("MyTransportEngine._connect_policy (see the TODO)")

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        # TODO: connect to this rank's sender within timeout_s and return MyReceiver.
        raise NotImplementedError("MyTransportEngine._connect_rollout (see the TODO)")

    def _release_transport(self) -> None:
        # TODO: free what _prepare_transport and the _connect methods acquired. Idempotent:
        # finalize() calls it after failures too, and before prepare() ever ran.
        pass
