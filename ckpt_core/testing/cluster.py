"""Real worker processes for conformance tests: one pool per backend and shape, many refits.

A :class:`ConformanceCluster` starts ``num_policy + num_rollout`` worker processes
(:class:`ckpt_core.orchestration.local.LocalProcessPool`) and drives them with
:class:`ckpt_core.orchestration.coordinator.RefitCoordinator`; every refit picks its own weights factory, so
one pool serves a whole test class. On top of the coordinator's per-tensor digest check, each
refit is checked for tensor order and for how every policy rank consumed its generator. After
a failure the next :meth:`~ConformanceCluster.ensure_ready` starts fresh processes, so one
failing test does not fail the tests after it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Sequence
from typing import Any

from ckpt_core.orchestration.coordinator import CallResult, RefitCoordinator, RefitFailedError, RefitReport
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.topology import Topology

PROBE_SERVICE = "ckpt_core.testing.services:ProbeWorker"
BLOCKING_PROBE_SERVICE = "ckpt_core.testing.services:BlockingProbeWorker"
WEIGHTS = "ckpt_core.testing.weights:"

# How LocalProcessPool reports a worker that died or stopped answering (and was killed).
_PROCESS_FAILURES = ("WorkerExited", "TimeoutError")

WorkerOptions = Callable[[dict[str, Any], str, int], dict[str, Any]]
"""``(engine_options, role, rank) -> engine options for that worker``."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """How many policy and rollout processes run, and the topology that connects them.

    ``topology=None`` runs the engine with its own default and checks that every rollout rank
    receives policy rank 0's weights. ``"broadcast"`` or ``"paired"`` (policy rank ``i`` feeds
    rollout rank ``i``) is also passed to the engine as its ``topology`` option.
    """

    num_policy: int
    num_rollout: int
    topology: str | None = None

    def __post_init__(self) -> None:
        for field in ("num_policy", "num_rollout"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Shape.{field} must be an int >= 1, got {value!r}")
        if self.topology is not None and not isinstance(self.topology, str):
            raise ValueError(f"Shape.topology must be None or a string, got {self.topology!r}")

    @classmethod
    def coerce(cls, value: Shape | Sequence[Any]) -> Shape:
        """A ``Shape`` from itself or a ``(num_policy, num_rollout[, topology])`` tuple."""
        if isinstance(value, Shape):
            return value
        if isinstance(value, (tuple, list)) and len(value) in (2, 3):
            return cls(*value)
        raise ValueError(f"a shape is Shape(...) or (num_policy, num_rollout[, topology]), got {value!r}")

    @property
    def id(self) -> str:
        """A short test id: ``"1p2r"``, ``"2p2r-paired"``."""
        base = f"{self.num_policy}p{self.num_rollout}r"
        return f"{base}-{self.topology}" if self.topology else base

    @property
    def paired(self) -> bool:
        return self.topology == Topology.PAIRED

    def source_rank(self, rollout_rank: int) -> int:
        """The policy rank whose weights ``rollout_rank`` must receive."""
        return Topology.parse(self.topology or "broadcast").source(rollout_rank)

    def worker_label(self, role: str, rank: int) -> str:
        return f"{role} rank {rank}"


class _State(enum.Enum):
    DOWN = "no processes"
    READY = "set up"
    FINALIZED = "finalized (setup() may run again on the same engines)"
    DIRTY = "needs fresh engines"
    BROKEN = "needs fresh processes"


class ConformanceCluster:
    """``shape``'s worker processes running ``backend``; see the module docstring.

    ``worker_options(engine_options, role, rank)`` may give each worker its own options (its
    own GPU, say). ``env`` is the workers' whole environment (``None``: inherit this one's).
    ``call_timeout_s`` bounds every lifecycle step: a worker that has not answered by then is
    killed and reported, so a hanging engine fails a test instead of stalling the run.
    ``blocking`` makes every worker drive its engine through the calls for callers that block
    (``send_weights_blocking``, ``receive_weight_batches_blocking``).
    """

    def __init__(
        self,
        *,
        backend: str,
        shape: Shape,
        bucket_size: int,
        engine_options: dict[str, Any] | None = None,
        worker_options: WorkerOptions | None = None,
        env: dict[str, str] | None = None,
        call_timeout_s: float = 120.0,
        blocking: bool = False,
    ) -> None:
        self.backend = backend
        self.blocking = blocking
        self.shape = shape
        self.bucket_size = bucket_size
        self.engine_options = dict(engine_options or {})
        if shape.topology is not None:
            self.engine_options["topology"] = shape.topology
        self.worker_options = worker_options
        self.env = env
        self.call_timeout_s = call_timeout_s
        self._pool: LocalProcessPool | None = None
        self._coordinator: RefitCoordinator | None = None
        self._state = _State.DOWN
        self._start_error: Exception | None = None

    # --- processes -----------------------------------------------------------------------

    def _specs(self) -> tuple[list[dict[str, Any]], list[str]]:
        specs, labels = refit_worker_specs(
            backend=self.backend,
            num_policy=self.shape.num_policy,
            num_rollout=self.shape.num_rollout,
            bucket_size=self.bucket_size,
            engine_kwargs=self.engine_options,
            weights=WEIGHTS + "nothing",
        )
        for spec in specs:
            if self.blocking:
                spec["service"] = BLOCKING_PROBE_SERVICE
            elif spec["role"] == "policy":
                spec["service"] = PROBE_SERVICE
            if self.worker_options is not None:
                options = self.worker_options(dict(self.engine_options), spec["role"], spec["rank"])
                spec["engine_kwargs"] = dict(options)
        return specs, labels

    def start(self) -> None:
        """Start fresh worker processes (closing any previous ones) and set them up.

        If the workers cannot even be started (the backend does not import there, an option
        is refused), later calls re-raise that error at once instead of trying again.
        """
        self.close()
        if self._start_error is not None:
            raise RuntimeError(f"the {self.shape.id} workers failed to start earlier: {self._start_error}")
        specs, labels = self._specs()
        try:
            self._pool = LocalProcessPool(specs, labels=labels, env=self.env, start_timeout_s=self.call_timeout_s)
        except Exception as exc:
            self._start_error = exc
            raise
        self._coordinator = RefitCoordinator(
            self._pool,
            num_policy=self.shape.num_policy,
            num_rollout=self.shape.num_rollout,
            timeout_s=self.call_timeout_s,
            topology="paired" if self.shape.paired else "broadcast",
        )
        self._state = _State.FINALIZED
        self.setup()

    def close(self) -> None:
        pool, self._pool, self._coordinator = self._pool, None, None
        self._state = _State.DOWN
        if pool is not None:
            pool.close()

    @property
    def pool(self) -> LocalProcessPool:
        if self._pool is None:
            raise RuntimeError("the cluster is not started: call ensure_ready() first")
        return self._pool

    @property
    def coordinator(self) -> RefitCoordinator:
        if self._coordinator is None:
            raise RuntimeError("the cluster is not started: call ensure_ready() first")
        return self._coordinator

    def rollout_index(self, rank: int) -> int:
        return self.shape.num_policy + rank

    # --- lifecycle -----------------------------------------------------------------------

    def ensure_ready(self) -> None:
        """Bring the cluster to "set up": fresh engines after a failed step, fresh processes if
        a worker died or hung (or the engines cannot be rebuilt)."""
        if self._state is _State.READY:
            return
        if self._state is _State.DIRTY:
            try:
                self._step(self.coordinator.recover)
                self._state = _State.READY
                return
            except Exception:  # noqa: BLE001 - fresh processes are the next remedy
                self._state = _State.BROKEN
        if self._state in (_State.DOWN, _State.BROKEN):
            self.start()
        else:
            self.setup()

    def setup(self) -> None:
        """``prepare()`` and init on every worker's current engine (again, after finalize)."""
        self._step(self.coordinator.setup)
        self._state = _State.READY

    def finalize(self) -> None:
        self._step(self.coordinator.finalize)
        self._state = _State.FINALIZED

    def mark_dirty(self) -> None:
        """The engines were used out of order: build fresh ones before the next refit."""
        if self._state is not _State.BROKEN and self._state is not _State.DOWN:
            self._state = _State.DIRTY

    def _step(self, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except RefitFailedError as exc:
            lost = any(f.error_type in _PROCESS_FAILURES for f in exc.failures)
            self._state = _State.BROKEN if lost else _State.DIRTY
            raise
        except BaseException:
            self._state = _State.BROKEN
            raise

    def refit(self, weights: str, params: dict[str, Any] | None = None) -> RefitReport:
        """One verified refit with the ``weights`` factory (a name in
        :mod:`ckpt_core.testing.weights`, or ``"module:function"``).

        Raises ``RefitFailedError`` if a worker failed or a tensor differs, and
        ``AssertionError`` if tensors arrived out of order or a policy rank did not consume its
        generator exactly once.
        """
        self.ensure_ready()
        target = weights if ":" in weights else WEIGHTS + weights
        report = self._step(lambda: self.coordinator.refit(weights=target, weights_params=dict(params or {})))
        self.check_order(report)
        self.check_consumption(report)
        return report

    def call(
        self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float | None = None
    ) -> list[CallResult]:
        """Raw worker calls (for out-of-order sequences); the engines count as used afterwards."""
        self.mark_dirty()
        results = self.pool.call(calls, self.call_timeout_s if timeout_s is None else timeout_s)
        if any(r.error_type in _PROCESS_FAILURES for r in results if not r.ok):
            self._state = _State.BROKEN
        return results

    # --- checks beyond the coordinator's digests --------------------------------------------

    def check_order(self, report: RefitReport) -> None:
        """Every rollout rank received its source's tensors in the order they were sent."""
        for rank, result in enumerate(report.rollout):
            sent = list(report.policy[self.shape.source_rank(rank)]["digests"])
            got = list(result["digests"])
            if got != sent:
                position = next((i for i, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
                raise AssertionError(
                    f"rollout rank {rank} received tensors out of order: at position {position} "
                    f"expected {sent[position : position + 3]}, got {got[position : position + 3]} "
                    f"({len(got)} tensors received, {len(sent)} sent). Batches must be yielded in "
                    "the sender's order."
                )

    def check_consumption(self, report: RefitReport) -> None:
        """Every policy rank pulled each item of its generator once and exhausted it."""
        for rank, result in enumerate(report.policy):
            seen = result.get("consumption")
            if seen is None:
                raise AssertionError(f"policy rank {rank} ran without the kit's ProbeWorker service")
            if not seen["exhausted"] or seen["pulled"] != seen["expected"]:
                raise AssertionError(
                    f"policy rank {rank}: send_weights returned after pulling {seen['pulled']} of "
                    f"{seen['expected']} weights (generator exhausted: {seen['exhausted']}). Every "
                    "policy rank, including one with no receiver, must run its generator to the end "
                    "exactly once before send_weights returns."
                )

    def __enter__(self) -> ConformanceCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_environment(extra: dict[str, str] | None) -> dict[str, str] | None:
    """This process's environment with ``extra`` on top (``None`` when there is nothing extra).

    ``PYTHONPATH`` entries in ``extra`` are prepended to the inherited ``PYTHONPATH``.
    """
    if not extra:
        return None
    env = dict(os.environ)
    for key, value in extra.items():
        if key == "PYTHONPATH" and env.get("PYTHONPATH"):
            env[key] = os.pathsep.join([value, env["PYTHONPATH"]])
        else:
            env[key] = value
    return env
