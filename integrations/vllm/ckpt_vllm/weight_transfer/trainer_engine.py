"""ckpt-engine as a vLLM weight-transfer backend: the trainer's side.

A trainer refits a vLLM server (or ``LLM``) with vLLM's own clients and factory::

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo

    info = CkptTrainerInitInfo(rank=0, transport="gloo_cpu", bucket_size_bytes=64 << 20,
                               rollout_world_size=2)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"), source=ModuleSource(model))
    engine.send_weights(weight_version="1")   # after each training step

Every trainer rank is a policy rank of ckpt-core's lifecycle (its own engine, sending its
weights in the transport's topology); rank 0 serves the metadata rendezvous and alone drives
the server's calls (``is_sender``). ``trainer_init`` runs the server's
``init_weight_transfer_engine`` beside its own init (both sides of the transport's rendezvous
must run at once); ``send_weights`` runs the server's ``start_weight_update`` and then its
``update_weights`` beside its own send, then ``finish_weight_update(weight_version)``. A
failure of either side ends the other at once (a refused update cancels the send; a lost
receiver fails it), and the error says what the server answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ckpt_vllm.plugin import require_ckpt_core

require_ckpt_core()

from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import InvalidArgumentError, LifecycleError, RemoteRefitError
from ckpt_core.options import MAX_TIMEOUT_S, check_bucket_size, check_count, check_kwargs_shape, check_positive_number
from ckpt_core.orchestration.rendezvous import MetadataRendezvous, exchange_metadata
from ckpt_core.registry import create_checkpoint_engine
from ckpt_vllm.errors import AdapterError
from ckpt_vllm.model.lora import adapter_path
from ckpt_vllm.plugin import BACKEND_NAME, register

Weights = Iterable[tuple[str, torch.Tensor]]

_SERVER_ANSWER_S = 30.0  # how long a failed send waits for the server's own error


def source_weights(source: Any) -> Weights:
    """A fresh pass over a vLLM ``WeightSource``'s full weights, in either of its shapes:
    vLLM 0.33's (``iter_full()``: every weight whole, as each trainer rank must send it beside
    ``iter_local()`` and ``owned_names(rank)``, which this backend does not need: each policy
    rank sends full weights in its transport's topology) or 0.32's (iterating the source).
    ``InvalidArgumentError`` for an object that is neither."""
    iter_full = getattr(source, "iter_full", None)
    if callable(iter_full):
        return iter_full()  # type: ignore[no-any-return]
    if hasattr(type(source), "__iter__"):
        return iter(source)  # type: ignore[no-any-return]
    raise InvalidArgumentError(
        f"source must be a vLLM WeightSource (iter_full() in vLLM 0.33, iterable in 0.32), got {type(source).__name__}"
    )


@dataclasses.dataclass
class CkptTrainerInitInfo(TrainerInitInfo):
    """What ``trainer_init`` takes on each trainer rank (``rank``, keyword-only, is its own).

    ``transport``, ``bucket_size_bytes`` and ``engine_kwargs`` build each side's engine (the
    server's workers get the same; ``rollout_engine_kwargs`` replaces them there, where the two
    sides need different ones, such as a device). ``world_size`` trainer ranks send to
    ``rollout_world_size`` inference workers (the server's tensor x pipeline x data-parallel
    size). Rank 0 serves the rendezvous on ``rendezvous_host:rendezvous_port`` (an address the
    server's workers reach; port 0 takes a free one, with one trainer rank only: the others
    must know it). ``timeout_s`` bounds the rendezvous and each call to the server.
    """

    backend: ClassVar[str] = BACKEND_NAME

    transport: str = ""
    bucket_size_bytes: int = 0
    rollout_world_size: int = 1
    world_size: int = 1
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout_engine_kwargs: dict[str, Any] | None = None
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 0
    timeout_s: float = 300.0

    def check(self) -> None:
        owner = "CkptTrainerInitInfo"
        if not isinstance(self.transport, str) or not self.transport:
            raise InvalidArgumentError(
                f"{owner}: transport must name an installed ckpt-core backend (`ckpt-engine list`), got "
                f"{self.transport!r}"
            )
        check_bucket_size(self.bucket_size_bytes, owner=owner)
        check_kwargs_shape(self.engine_kwargs)
        if self.rollout_engine_kwargs is not None:
            check_kwargs_shape(self.rollout_engine_kwargs)
        for name in ("rollout_world_size", "world_size"):
            if check_count(owner, name, getattr(self, name)) < 1:
                raise InvalidArgumentError(f"{owner}: {name} must be >= 1, got {getattr(self, name)}")
        if check_count(owner, "rank", self.rank) >= self.world_size:
            raise InvalidArgumentError(f"{owner}: rank must be in [0, world_size={self.world_size}), got {self.rank}")
        check_count(owner, "rendezvous_port", self.rendezvous_port)
        if self.rendezvous_port == 0 and self.world_size > 1:
            raise InvalidArgumentError(
                f"{owner}: with world_size={self.world_size} every trainer rank must reach rank 0's rendezvous: "
                "give rendezvous_port (and rendezvous_host) explicitly"
            )
        check_positive_number(owner, "timeout_s", self.timeout_s, MAX_TIMEOUT_S)

    def worker_init_info(self, rendezvous: str) -> dict[str, Any]:
        """The server's ``init_info`` (:class:`ckpt_vllm.weight_transfer.worker_engine.CkptInitInfo`
        as JSON); this rank's ``timeout_s`` bounds the workers' wait at the rendezvous too."""
        kwargs = self.engine_kwargs if self.rollout_engine_kwargs is None else self.rollout_engine_kwargs
        return {
            "transport": self.transport,
            "bucket_size_bytes": self.bucket_size_bytes,
            "engine_kwargs": dict(kwargs),
            "rendezvous": rendezvous,
            "train_world_size": self.world_size,
            "rollout_world_size": self.rollout_world_size,
            "rendezvous_timeout_s": self.timeout_s,
        }


class CkptTrainerWeightTransferEngine(TrainerWeightTransferEngine[CkptTrainerInitInfo]):
    """One trainer rank's side of ckpt-engine refits through vLLM's client (module docstring)."""

    init_info_cls = CkptTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: CkptTrainerInitInfo | None = None
        self.engine: CheckpointEngine | None = None
        self.failure: str | None = None  # why this engine takes no more refits

    @classmethod
    def trainer_init(cls, init_info: CkptTrainerInitInfo, *, client: Any, source: Any = None) -> Self:
        """Build this rank's engine and connect it to the server's workers (module docstring)."""
        if not isinstance(init_info, CkptTrainerInitInfo):
            raise InvalidArgumentError(f"trainer_init takes a CkptTrainerInitInfo, got {type(init_info).__name__}")
        init_info.check()
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        engine = create_checkpoint_engine(
            init_info.transport,
            bucket_size_bytes=init_info.bucket_size_bytes,
            engine_kwargs=dict(init_info.engine_kwargs),
        )
        try:
            own = engine.prepare()
            served = (
                MetadataRendezvous(init_info.rendezvous_host, init_info.rendezvous_port, timeout_s=init_info.timeout_s)
                if self.is_sender
                else None
            )
            address = served.address if served else f"{init_info.rendezvous_host}:{init_info.rendezvous_port}"
            try:
                with _ServerCall(
                    self.client.init_weight_transfer_engine if self.is_sender else None,
                    init_info.worker_init_info(address),
                    what="init_weight_transfer_engine",
                ) as server:
                    metadata = exchange_metadata(
                        address,
                        role="policy",
                        rank=init_info.rank,
                        entry=own,
                        train_world_size=init_info.world_size,
                        rollout_world_size=init_info.rollout_world_size,
                        timeout_s=init_info.timeout_s,
                        give_up=server.failure,
                    )
                    engine.init_policy_process_group(
                        worker_rank=init_info.rank,
                        train_world_size=init_info.world_size,
                        rollout_world_size=init_info.rollout_world_size,
                        metadata=metadata,
                    )
                    server.result(init_info.timeout_s)
            finally:
                if served is not None:
                    served.close()
        except BaseException:
            engine.finalize()
            raise
        self.engine = engine
        return self

    def send_weights(self, weights: Weights | None = None, *, weight_version: str | None = None) -> None:
        """One refit: ``weights`` (pairs of name and tensor; default: a fresh pass over the
        ``source`` given to ``trainer_init``) sent through this rank's engine while the server
        receives them; then, on rank 0, ``finish_weight_update(weight_version)`` (the server's
        ``/weight_info`` then reports it). A failure leaves this engine unusable: call
        ``trainer_init`` again (the server's workers then build fresh engines too)."""
        engine, info = self._ready()
        if weights is None:
            if self.source is None:
                raise InvalidArgumentError("send_weights: no weights given and no source at trainer_init")
            weights = source_weights(self.source)
        try:
            # The server's start and update run beside the send from its first byte: a
            # transport's first bucket travels while vLLM's calls reach the workers (what
            # arrives early waits for the receive, as every other trainer rank's send does).
            with _ServerCall(
                self._start_and_update if self.is_sender else None, {}, what="start_weight_update/update_weights"
            ) as server:
                asyncio.run(_send_unless(engine.send_weights(pair for pair in weights), server))
                server.result(info.timeout_s)
            if self.is_sender:
                self.client.finish_weight_update(weight_version)
        except BaseException as exc:
            self.failure = f"a refit failed ({type(exc).__name__}: {exc})"
            engine.finalize()
            if self.is_sender:
                self._close_update()
            raise

    def send_adapter(
        self, name: str, weights: Weights, *, config: Mapping[str, Any], version: str
    ) -> list[dict[str, Any]]:
        """One LoRA adapter refit of a ``vllm serve`` (vLLM's HTTP client only): ``weights``
        (PEFT's names, ``<module>.lora_A.weight`` and ``.lora_B.weight``; ``config`` its PEFT
        ``LoraConfig`` fields: ``r``, ``lora_alpha``, ``target_modules``) sent through this
        rank's engine while every server worker receives them as ``version`` of adapter ``name``
        and holds them in memory, checked (:mod:`ckpt_vllm.model.lora`; the model's weights and
        the weight version are untouched). Then, on rank 0, the server's ``/v1/load_lora_adapter``
        serves that version under ``name`` in place of the one before, which serves until then;
        requests name the adapter as their ``model``, and ``/v1/models`` lists its path,
        ``ckpt-engine://<name>@<version>``. Each worker's account of what it holds (rank 0).

        The server needs ``--enable-lora``, the worker extension (``--worker-extension-cls
        ckpt_vllm.weight_transfer.extension.CkptEngineWorkerExtension``) and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` beside ``VLLM_SERVER_DEV_MODE=1``. A bad adapter
        raises :class:`~ckpt_vllm.errors.AdapterError` naming each worker's reason, the previous
        version serving on and this engine usable; any other failure leaves this engine
        unusable, as in :meth:`send_weights`. Give every refit a new ``version`` (vLLM keys its
        prefix cache by it)."""
        base_url = getattr(self.client, "base_url", None)
        if self.is_sender and not isinstance(base_url, str):
            raise InvalidArgumentError(
                f"send_adapter reaches the server over HTTP: trainer_init with vLLM's HTTPVLLMWeightSyncClient, got "
                f"{type(self.client).__name__}"
            )
        if not isinstance(name, str) or not name or not isinstance(version, str) or not version or "@" in version:
            raise InvalidArgumentError(
                f"send_adapter: name and version must be non-empty strings, the version without '@'; got {name!r}, "
                f"{version!r}"
            )
        engine, info = self._ready()
        call = {
            "method": "ckpt_engine_receive_adapter",
            "kwargs": {"name": name, "config": dict(config), "version": version},
            "timeout": info.timeout_s,
        }
        try:
            receive = self._receive_adapter if self.is_sender else None
            with _ServerCall(receive, call, what="ckpt_engine_receive_adapter") as server:
                asyncio.run(_send_unless(engine.send_weights(pair for pair in weights), server))
                replies = server.result(info.timeout_s)
        except BaseException as exc:
            self.failure = f"an adapter refit failed ({type(exc).__name__}: {exc})"
            engine.finalize()
            raise
        if not self.is_sender:
            return []
        refused = _refusals(replies)
        if refused:
            raise AdapterError(f"adapter {name!r} version {version!r} refused, the old one serves on: {refused}")
        load = {"lora_name": name, "lora_path": adapter_path(name, version), "load_inplace": True}
        with _ServerCall(self._post_json, ("v1/load_lora_adapter", load), what="/v1/load_lora_adapter") as server:
            server.result(info.timeout_s)
        return [r["result"] for r in replies]

    def _receive_adapter(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """The workers' replies to ``ckpt_engine_receive_adapter``; ``RemoteRefitError`` for any
        failure but a refused adapter (the send is then ended at once, see ``_send_unless``)."""
        replies = list(self._post_json(("collective_rpc", call))["results"])
        failed = [r for r in replies if not r.get("ok") and r.get("error_type") != "AdapterError"]
        if failed:
            raise RemoteRefitError(f"the server's workers failed to receive the adapter: {_refusals(replies)}")
        return replies

    def _post_json(self, route_and_body: tuple[str, dict[str, Any]]) -> Any:
        """POST ``body`` to the server's ``route``; its JSON answer (``None`` for none)."""
        import requests

        route, body = route_and_body
        response = requests.post(f"{self.client.base_url}/{route}", json=body, timeout=self.client.timeout)
        response.raise_for_status()
        return response.json() if response.headers.get("content-type", "").startswith("application/json") else None

    def _start_and_update(self, update_info: dict[str, Any]) -> None:
        try:
            self.client.start_weight_update()
        except Exception as exc:
            if _STALE_UPDATE not in f"{exc} {getattr(getattr(exc, 'response', None), 'text', '')}":
                raise
            # A trainer that died between the server's start and its update left the update
            # open (no update call came to fail it): close it, setting no version, and start.
            self._close_update()
            self.client.start_weight_update()
        self.client.update_weights(update_info)

    def _close_update(self) -> None:
        """Close the server's update after a failed one. Only its last worker raised (see
        ``ckpt_vllm.weight_transfer.worker_engine.settle``), so vLLM closed the update there
        alone; the others would refuse the next ``start_weight_update``. This finish closes it
        on them (the last worker refuses it, last, which leaves vLLM's replies in order) and
        sets no version."""
        with contextlib.suppress(Exception):
            self.client.finish_weight_update(None)

    def shutdown(self) -> None:
        """Finalize this rank's engine (the server's stays until its own shutdown call)."""
        engine, self.engine = self.engine, None
        self.failure = "shut down"
        if engine is not None:
            engine.finalize()

    def _ready(self) -> tuple[CheckpointEngine, CkptTrainerInitInfo]:
        if self.engine is None or self.info is None or self.failure is not None:
            why = self.failure or "not initialized"
            raise LifecycleError(f"this trainer engine takes no more refits ({why}): call trainer_init again")
        return self.engine, self.info


# What vLLM's worker says when a start finds an update still open.
_STALE_UPDATE = "weight update is already active"


class _ServerCall:
    """``call(payload)`` on a thread of its own while this thread does its side (``call``
    ``None``: nothing to run, on a trainer rank that does not drive the server)."""

    def __init__(self, call: Callable[[Any], Any] | None, payload: Any, *, what: str) -> None:
        self.what = what
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-vllm-{what}")
        self.future = self._pool.submit(call, payload) if call is not None else None

    def __enter__(self) -> _ServerCall:
        return self

    def __exit__(self, *exc: object) -> None:
        # Never joined on an error: a server call still running would hold the error back.
        self._pool.shutdown(wait=False)

    def failure(self) -> BaseException | None:
        """The server's error once its call failed, else ``None`` (it may still be running)."""
        if self.future is None or not self.future.done() or self.future.exception() is None:
            return None
        return self._explained(self.future.exception())

    def failure_within(self, timeout_s: float) -> BaseException | None:
        """:meth:`failure`, waiting up to ``timeout_s`` for the call to end."""
        if self.future is not None:
            concurrent.futures.wait([self.future], timeout_s)
        return self.failure()

    def result(self, timeout_s: float) -> Any:
        """Wait for the call: its value, or its error, with what the server said, as
        ``RemoteRefitError``."""
        if self.future is None:
            return None
        try:
            return self.future.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise RemoteRefitError(f"the server's {self.what} did not answer within {timeout_s:g}s") from exc
        except BaseException as exc:  # noqa: BLE001 - explained below
            raise self._explained(exc) from exc

    def _explained(self, exc: BaseException | None) -> BaseException:
        body = getattr(getattr(exc, "response", None), "text", None)  # an HTTP error's answer
        said = f"{exc}" + (f"; the server answered: {body}" if body else "")
        return RemoteRefitError(f"the server's {self.what} failed: {type(exc).__name__}: {said}")


def _refusals(replies: list[dict[str, Any]]) -> str:
    """What the workers whose reply is an error said (empty: none)."""
    return "; ".join(
        f"worker {rank}: {r.get('error_type')}: {r.get('message')}" for rank, r in enumerate(replies) if not r.get("ok")
    )


async def _send_unless(send: Any, server: _ServerCall) -> None:
    """Run ``send`` (a coroutine) to its end, or until the server's call fails: then cancel it
    (the engine's receivers hear at once) and raise the server's error."""
    task = asyncio.ensure_future(send)
    while not task.done():
        await asyncio.wait({task}, timeout=0.05)
        failure = server.failure()
        if failure is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise failure
    try:
        task.result()
    except BaseException as sent:
        # The server's answer says more (the weight vLLM refused) than the closed connection
        # the send saw: wait a little for it.
        failure = await asyncio.to_thread(server.failure_within, _SERVER_ANSWER_S)
        if failure is not None:
            raise failure from sent
        raise


# A trainer process need not load vLLM's plug-ins: importing this module makes the factory
# know the backend too (register() is idempotent).
register()
