"""Refits between Ray actors: the local coordinator's lifecycle, over actor handles.

Install with ``pip install 'ckpt-core[ray]'``; importing ``ckpt_core`` never imports this module
(nor Ray). Two sides:

* **Actors** host an engine by mixing :class:`RefitActorMixin` into their class. A policy actor
  overrides :meth:`~RefitActorMixin.weights` (a generator of ``(name, tensor)`` from its model),
  a rollout actor overrides :meth:`~RefitActorMixin.load_weights` (hands one received batch to
  its model's loader). :class:`RefitActor` is a ready-made actor body without a model, for
  benchmarks and tests (its policy side sends a ``"module:function"`` weights factory).
* **The driver** builds a :class:`RayRefitCoordinator` from the actor handles and a config
  mapping, then calls ``setup()``, ``refit()`` after every training step, and ``finalize()``.
  It *is* a :class:`~ckpt_core.orchestration.coordinator.RefitCoordinator` over a :class:`RayWorkerPool`, so
  the lifecycle, its checks and its errors are the local launcher's.

Every call between driver and actors is one JSON text in, one JSON text out (the local
launcher's protocol, :mod:`ckpt_core.orchestration.protocol`); no Python object is pickled for a
refit. Tensors move only through the engine's transport.

Engines advertise the address of the actor's node (``ray.util.get_node_ip_address()``), not
loopback, so peers on other nodes can reach them; set the engine option ``host`` to override.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

try:
    import ray
    import ray.actor
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ckpt_core.orchestration.ray needs Ray ({exc}); install it with: pip install 'ckpt-core[ray]'"
    ) from exc

import torch

from ckpt_core.errors import EngineOptionError, LifecycleError
from ckpt_core.options import check_bucket_size, schema_of
from ckpt_core.orchestration.coordinator import CallResult, RefitCoordinator, RefitFailedError
from ckpt_core.orchestration.protocol import decode, encode, error_reply
from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.orchestration.workload import WeightsFactory
from ckpt_core.registry import resolve_backend
from ckpt_core.topology import Topology

__all__ = [
    "RayRefitConfig",
    "RayRefitCoordinator",
    "RayWorkerPool",
    "RefitActor",
    "RefitActorMixin",
    "ray_service_pool",
]

DEFAULT_BUCKET_SIZE = 64 << 20


# --- configuration -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RayRefitConfig:
    """What every actor's engine is built from; made from a plain mapping by :meth:`from_mapping`.

    ``backend``: a registered backend name or ``"module:ClassName"``. ``bucket_size_bytes``:
    the engine's bucket size (default 64 MiB). ``engine_kwargs``: the engine's named options
    (``host`` defaults to the actor's node address where the engine has that option).
    ``verify``: compare per-tensor digests of every rollout actor against its source after each
    refit (costs a second pass over the policy's weights). ``weights`` / ``weights_params``: a
    ``"module:function"`` weights factory for policy actors that do not override ``weights()``.
    """

    backend: str
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    verify: bool = True
    weights: str | None = None
    weights_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> RayRefitConfig:
        """Validate ``config``; ``EngineOptionError`` names the offending key and what is expected."""
        if not isinstance(config, Mapping):
            raise EngineOptionError(f"the refit config must be a mapping, got {type(config).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in config if key not in known)
        if unknown:
            raise EngineOptionError(
                f"unknown refit config key(s) {', '.join(map(repr, unknown))}; accepted keys: "
                f"{', '.join(known)} (engine options go under 'engine_kwargs')"
            )
        if "backend" not in config:
            raise EngineOptionError("the refit config needs 'backend' (e.g. 'gloo_cpu')")
        _expect(config, "backend", str, "a backend name such as 'gloo_cpu'", nonempty=True)
        size = check_bucket_size(config.get("bucket_size_bytes", DEFAULT_BUCKET_SIZE), owner="refit config")
        _expect(config, "engine_kwargs", Mapping, "a mapping of engine option name to value")
        _expect(config, "verify", bool, "True or False")
        if config.get("weights") is not None:
            _expect(config, "weights", str, "a 'module:function' weights factory", nonempty=True)
        _expect(config, "weights_params", Mapping, "a mapping passed to the weights factory")
        settings = cls(
            backend=config["backend"],
            bucket_size_bytes=size,
            engine_kwargs=dict(config.get("engine_kwargs", {})),
            verify=config.get("verify", True),
            weights=config.get("weights"),
            weights_params=dict(config.get("weights_params", {})),
        )
        try:
            json.dumps(dataclasses.asdict(settings))
        except (TypeError, ValueError) as exc:
            raise EngineOptionError(f"the refit config must hold JSON-compatible values only: {exc}") from exc
        return settings

    def worker_kwargs(self, role: str, rank: int) -> dict[str, Any]:
        """The ``configure`` call's arguments for the actor of ``role`` and ``rank``."""
        kwargs: dict[str, Any] = {
            "role": role,
            "rank": rank,
            "backend": self.backend,
            "bucket_size": self.bucket_size_bytes,
            "engine_kwargs": dict(self.engine_kwargs),
            "verify": self.verify,
        }
        if role == "policy" and self.weights is not None:
            kwargs.update(weights=self.weights, weights_params=dict(self.weights_params))
        return kwargs


def _expect(config: Mapping[str, Any], key: str, kind: Any, what: str, *, nonempty: bool = False) -> None:
    """``EngineOptionError`` unless ``config[key]`` (when present) is a ``kind``."""
    if key not in config:
        return
    value = config[key]
    if not isinstance(value, kind) or (nonempty and not value):
        raise EngineOptionError(f"refit config {key!r} must be {what}, got {value!r}")


# --- the actor side ------------------------------------------------------------------------


class RefitActorMixin:
    """Mix into a Ray actor class to host one refit engine (policy or rollout side).

    Override :meth:`weights` in policy actors and :meth:`load_weights` in rollout actors. The
    coordinator reaches the engine only through :meth:`ckpt_call`, with JSON text; the
    tensors never leave the actor except through the engine's transport.

    Any actor kind works. In a threaded actor ``ckpt_call`` runs each call to completion
    (a refit on an event loop of its own). An async actor (a class with an ``async def``
    method; Ray then runs every method on the actor's event loop) gets a coroutine
    ``ckpt_call`` instead, chosen when the class is defined: a refit is awaited there, its
    transfer on the engine's refit thread, so the actor's other coroutines keep running
    during it. The other calls (``prepare``, ``init``, which waits for its peers within the
    engine's ``timeout_s``, ``finalize``...) are the engine's synchronous methods and run on
    the loop's thread. The policy's :meth:`weights` generator is iterated on the engine's
    refit thread in both kinds; :meth:`load_weights` runs on the calling thread.
    """

    _ckpt_worker: RefitWorker | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "ckpt_call" not in cls.__dict__ and _is_async_actor_class(cls):
            cls.ckpt_call = _ckpt_call_async  # type: ignore[assignment, method-assign]

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Policy side: the ``(name, tensor)`` pairs to send, in a stable order (for instance
        ``model.state_dict().items()``). Called once per refit, and once more for the digests
        when the config has ``verify`` on."""
        raise NotImplementedError(f"{type(self).__name__} does not override weights()")

    def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Rollout side: load one received batch of ``(name, tensor)`` into the model. The
        tensors are the actor's own (the engine does not reuse them)."""
        raise NotImplementedError(f"{type(self).__name__} does not override load_weights()")

    def ckpt_call(self, request: str) -> str:
        """Run one coordinator call: ``{"method": ..., "kwargs": {...}}`` as JSON text in, the
        reply of :mod:`ckpt_core.orchestration.protocol` as JSON text out; errors come back in the reply.
        (A coroutine in async actors, see the class docstring.)"""
        try:
            handler, kwargs = _parse_call(request)
            reply: dict[str, Any] = {"ok": True, "result": handler(self, **kwargs)}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the coordinator
            reply = error_reply(exc)
        return encode(reply).decode()


async def _ckpt_call_async(self: RefitActorMixin, request: str) -> str:
    """``ckpt_call`` of an async actor: a refit is awaited on the actor's event loop."""
    try:
        handler, kwargs = _parse_call(request)
        if handler is _ACTOR_CALLS["refit"]:
            result = await _worker(self).refit_async(**kwargs)
        else:
            result = handler(self, **kwargs)
        reply: dict[str, Any] = {"ok": True, "result": result}
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the coordinator
        reply = error_reply(exc)
    return encode(reply).decode()


def _parse_call(request: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    message = decode(request.encode())
    method, kwargs = message.get("method"), dict(message.get("kwargs") or {})
    handler = _ACTOR_CALLS.get(method) if isinstance(method, str) else None
    if handler is None:
        raise ValueError(f"unknown refit call {method!r}; expected one of {', '.join(_ACTOR_CALLS)}")
    return handler, kwargs


def _is_async_actor_class(cls: type) -> bool:
    """Whether Ray makes an actor of ``cls`` an async actor: it has an ``async def`` method
    (or async generator method); ``ckpt_call`` itself does not count."""
    for name in dir(cls):
        if name == "ckpt_call":
            continue
        member = inspect.getattr_static(cls, name, None)
        function = getattr(member, "__func__", member)  # static and class methods
        if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
            return True
    return False


class RefitActor(RefitActorMixin):
    """A ready-made actor body without a model: its policy side sends the config's weights
    factory, its rollout side keeps what it receives for the refit (and reports digests).
    Wrap it as ``ray.remote(num_cpus=0)(RefitActor)``."""


def _overrides(actor: RefitActorMixin, name: str) -> bool:
    """Whether the actor's class defines its own ``name`` rather than the mixin's default.

    Ray runs an actor as a subclass of the user's class (marked ``__ray_actor_class__``) whose
    methods are Ray's wrappers, so that subclass is skipped.
    """
    for klass in type(actor).__mro__:
        if "__ray_actor_class__" in vars(klass):
            continue
        if name in vars(klass):
            return klass is not RefitActorMixin
    return False


def _node_host(backend: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` with ``host`` set to this node's address, if the engine's options
    schema has a ``host`` option and the caller did not set it."""
    if "host" in engine_kwargs:
        return engine_kwargs
    schema = schema_of(resolve_backend(backend))
    if schema is None or "host" not in schema:
        return engine_kwargs
    return {**engine_kwargs, "host": ray.util.get_node_ip_address()}


def _configure(
    actor: RefitActorMixin,
    *,
    role: str,
    rank: int,
    backend: str,
    bucket_size: int,
    engine_kwargs: dict[str, Any] | None = None,
    verify: bool = True,
    weights: str | None = None,
    weights_params: dict[str, Any] | None = None,
    hook_plugins: list[str] | None = None,
) -> dict[str, Any]:
    """(Re)build the actor's engine; an earlier engine is finalized first."""
    old, actor._ckpt_worker = actor._ckpt_worker, None
    if old is not None:
        old.finalize()
    source: str | WeightsFactory | None = weights
    if role == "policy" and weights is None:
        if not _overrides(actor, "weights"):
            raise ValueError(
                f"{type(actor).__name__} has no weights to send: override weights() in the actor "
                "class, or give the config a 'weights' factory ('module:function')"
            )
        source = _as_factory(actor.weights)

    loader = actor.load_weights if role == "rollout" and _overrides(actor, "load_weights") else None
    actor._ckpt_worker = RefitWorker(
        role=role,  # type: ignore[arg-type]  # RefitWorker checks the value
        rank=rank,
        backend=backend,
        bucket_size=bucket_size,
        engine_kwargs=_node_host(backend, dict(engine_kwargs or {})),
        weights=source,
        weights_params=weights_params,
        verify=verify,
        hook_plugins=hook_plugins,
        load_weights=loader,
    )
    return _describe(actor)


def _as_factory(weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> WeightsFactory:
    """An actor's ``weights()`` as a weights factory (see :mod:`ckpt_core.orchestration.workload`)."""

    def factory(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterable[tuple[str, torch.Tensor]]:
        return weights()

    return factory


def _describe(actor: RefitActorMixin) -> dict[str, Any]:
    """Where this actor runs and what its engine was built with."""
    worker = _worker(actor)
    return {
        "role": worker.role,
        "rank": worker.rank,
        "backend": worker.backend,
        "engine": type(worker.engine).__name__,
        "engine_kwargs": worker.engine_kwargs,
        "topology": getattr(worker.engine, "topology", None),
        "loads_weights": worker.load_weights is not None,
        "node_ip": ray.util.get_node_ip_address(),
        "actor_id": ray.get_runtime_context().get_actor_id(),
        "pid": os.getpid(),
    }


def _worker(actor: RefitActorMixin) -> RefitWorker:
    if actor._ckpt_worker is None:
        raise LifecycleError(f"{type(actor).__name__} has no engine yet: the coordinator configures it first")
    return actor._ckpt_worker


_ACTOR_CALLS: dict[str, Any] = {
    "configure": _configure,
    "describe": _describe,
    "prepare": lambda actor: _worker(actor).prepare(),
    "init": lambda actor, **kwargs: _worker(actor).init(**kwargs),
    "refit": lambda actor, **kwargs: _worker(actor).refit(**kwargs),
    "commit": lambda actor, **kwargs: _worker(actor).commit(**kwargs),
    "discard": lambda actor: _worker(actor).discard(),
    "finalize": lambda actor: _worker(actor).finalize(),
    "reset": lambda actor: _worker(actor).reset(),
}


# --- the driver side -----------------------------------------------------------------------


def _actor_id(handle: Any) -> str:
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else "<unknown id>"


def _death_reason(exc: BaseException) -> str:
    """Ray's multi-line actor-death text as one line: its summary, pid and node, and cause."""
    lines = str(exc).splitlines()
    details = dict(line.strip().split(": ", 1) for line in lines[1:] if line.startswith("\t") and ": " in line)
    prose = " ".join(line.strip() for line in lines if line.strip() and not line.startswith("\t"))
    where = ", ".join(f"{key} {details[key]}" for key in ("pid", "ip") if key in details)
    return f"{prose} ({where})" if where else prose


class RayWorkerPool:
    """A :class:`~ckpt_core.orchestration.coordinator.WorkerPool` over Ray actors that mix in
    :class:`RefitActorMixin`; ``labels[i]`` names actor ``i`` (e.g. ``"rollout rank 1"``) and
    every error names it with its actor id.

    ``call`` submits every call at once and waits with one deadline. A call that fails on the
    actor, an actor that died (``RayActorError``) and a call past its deadline all become
    failed ``CallResult``s; nothing hangs. Ray cannot interrupt a method that is running, so an
    actor whose call timed out may stay busy until its engine's own ``timeout_s`` passes.
    """

    def __init__(self, actors: Sequence[Any], labels: Sequence[str] | None = None) -> None:
        actors = list(actors)
        names = list(labels) if labels is not None else [f"actor {i}" for i in range(len(actors))]
        if len(names) != len(actors):
            raise ValueError(f"{len(actors)} actors but {len(names)} labels")
        for name, handle in zip(names, actors):
            if not isinstance(handle, ray.actor.ActorHandle):
                raise TypeError(f"{name}: expected a Ray actor handle, got {type(handle).__name__}")
            if not hasattr(handle, "ckpt_call"):
                raise TypeError(
                    f"{name} (Ray actor {_actor_id(handle)}) does not host a refit engine: mix "
                    "ckpt_core.orchestration.ray.RefitActorMixin into its class"
                )
        self.actors = actors
        self.labels = [f"{name} (Ray actor {_actor_id(handle)})" for name, handle in zip(names, actors)]

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        """Call each ``(actor_index, method, kwargs)`` concurrently; one result per call, in order."""
        requests = [encode({"method": method, "kwargs": kwargs}).decode() for _, method, kwargs in calls]
        deadline = time.monotonic() + timeout_s
        results: list[CallResult | None] = [None] * len(calls)
        pending: dict[Any, int] = {}
        for position, ((index, _, _), request) in enumerate(zip(calls, requests)):
            try:
                pending[self.actors[index].ckpt_call.remote(request)] = position
            except Exception as exc:  # noqa: BLE001 - a handle that cannot submit is this call's failure
                results[position] = CallResult.failure(self.labels[index], type(exc).__name__, str(exc))
        waiting = list(pending)
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=remaining)
            for ref in ready:
                position = pending[ref]
                index, method, _ = calls[position]
                results[position] = self._collect(self.labels[index], method, ref)
        for ref in waiting:
            position = pending[ref]
            index, method, _ = calls[position]
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # a queued call never starts; a running one keeps running
            results[position] = CallResult.failure(
                self.labels[index],
                "TimeoutError",
                f"did not answer {method}() within {timeout_s:g}s (the actor may still be running "
                "it; its engine's timeout_s bounds that)",
            )
        return [r for r in results if r is not None]

    @staticmethod
    def _collect(label: str, method: str, ref: Any) -> CallResult:
        try:
            return CallResult.from_reply(label, decode(ray.get(ref).encode()))
        except ray.exceptions.RayActorError as exc:
            reason = f"the actor died, {method}() did not complete: {_death_reason(exc)}"
            return CallResult.failure(label, type(exc).__name__, reason)
        except ray.exceptions.RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return CallResult.failure(label, type(exc).__name__, f"{method}() failed in Ray: {first}")
        except ValueError as exc:
            return CallResult.failure(label, "WireFormatError", f"malformed reply to {method}(): {exc}")


class RayRefitCoordinator(RefitCoordinator):
    """The refit lifecycle over Ray actors: ``policy`` and ``rollout`` are actor handles whose
    classes mix in :class:`RefitActorMixin`, in rank order; ``config`` builds their engines
    (see :class:`RayRefitConfig`).

    Construction builds an engine in every actor (``configure``), and raises
    ``RefitFailedError`` naming each actor that could not (an unknown backend, a bad option, a
    policy actor without weights...). Then, as for every ``RefitCoordinator``: ``setup()``,
    ``refit()`` (raises ``RefitFailedError`` naming every failed actor by role, rank and actor
    id; ``weight_version`` increases only when every rollout actor succeeded), ``recover()``
    after a failure, ``finalize()``. The actors stay the caller's: nothing here kills them.
    ``workers`` holds each actor's ``describe`` answer (node, address, engine options).
    """

    def __init__(
        self,
        policy: Sequence[Any],
        rollout: Sequence[Any],
        config: Mapping[str, Any],
        *,
        timeout_s: float = 600.0,
    ) -> None:
        settings = RayRefitConfig.from_mapping(config)
        policy, rollout = list(policy), list(rollout)
        labels = [f"policy rank {r}" for r in range(len(policy))] + [f"rollout rank {r}" for r in range(len(rollout))]
        pool = RayWorkerPool(policy + rollout, labels)
        super().__init__(
            pool, num_policy=len(policy), num_rollout=len(rollout), timeout_s=timeout_s, verify=settings.verify
        )
        self.config = settings
        calls = [(i, "configure", settings.worker_kwargs("policy", i)) for i in self.policy_workers]
        calls += [(i, "configure", settings.worker_kwargs("rollout", r)) for r, i in enumerate(self.rollout_workers)]
        self.workers: list[dict[str, Any]] = self._checked("configure", calls)
        topology = self.workers[0].get("topology")
        if isinstance(topology, str):
            self.topology = Topology.parse(topology)


@contextlib.contextmanager
def ray_service_pool(
    specs: Sequence[dict[str, Any]],
    labels: Sequence[str],
    *,
    address: str | None = None,
    actor_num_cpus: float = 0.0,
    start_timeout_s: float = 300.0,
) -> Iterator[RayWorkerPool]:
    """A pool of :class:`RefitActor` actors built from ``RefitWorker`` service specs (those of
    :func:`ckpt_core.orchestration.worker.refit_worker_specs`), for ``ckpt-engine bench --launcher ray``.

    Joins the Ray cluster at ``address`` (or starts a local one) unless Ray is already
    initialized; actors are spread over the cluster's nodes. On exit the actors are killed and
    a cluster started here is shut down.
    """
    for spec in specs:
        if spec.get("service") != "ckpt_core.orchestration.worker:RefitWorker":
            raise ValueError(f"the Ray launcher hosts RefitWorker services only, got {spec.get('service')!r}")
    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
        started = True
    actors: list[Any] = []
    try:
        actor_class = ray.remote(RefitActor).options(num_cpus=actor_num_cpus, scheduling_strategy="SPREAD")
        actors = [actor_class.remote() for _ in specs]
        pool = RayWorkerPool(actors, labels)
        configure = [(i, "configure", {k: v for k, v in s.items() if k != "service"}) for i, s in enumerate(specs)]
        failed = [r for r in pool.call(configure, start_timeout_s) if not r.ok]
        if failed:
            raise RefitFailedError("starting Ray actors", failed)
        yield pool
    finally:
        for handle in actors:
            with contextlib.suppress(Exception):
                ray.kill(handle)
        if started:
            ray.shutdown()
