"""``RefitCoordinator``: the refit lifecycle over P policy and R rollout workers.

The coordinator knows the lifecycle, not how workers run: it talks to a ``WorkerPool``
(local subprocesses in :mod:`ckpt_core.orchestration.local`, Ray actors in :mod:`ckpt_core.orchestration.ray`)
whose workers host :class:`ckpt_core.orchestration.worker.RefitWorker` objects. Workers ``0..P-1`` are the
policy ranks, ``P..P+R-1`` the rollout ranks.

A refit is complete only when every rollout rank received every tensor (and, with
``verify``, each one bit-exact against its sender's source); only then are the rollout workers
told to ``commit`` it and does ``weight_version`` increase. A refit whose rollout ranks
report other digests or tensor counts than their senders' is rejected: the rollout workers are
told to ``discard`` it, so no later ``commit`` (from anyone) can make it current. Any failure
raises one ``RefitFailedError`` naming every worker that failed, by role and rank, with its
error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from ckpt_core.errors import InvalidArgumentError, LifecycleError, TransferError
from ckpt_core.topology import Topology


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One worker's answer to one call: its value, or the error it raised (as text)."""

    worker: str
    ok: bool
    value: Any = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None

    @classmethod
    def from_reply(cls, worker: str, reply: dict[str, Any]) -> CallResult:
        if reply.get("ok"):
            return cls(worker, True, reply.get("result"))
        return cls(worker, False, None, reply.get("error_type"), reply.get("message"), reply.get("traceback"))

    @classmethod
    def failure(cls, worker: str, error_type: str, message: str) -> CallResult:
        return cls(worker, False, None, error_type, message)

    def describe(self) -> str:
        return f"{self.worker}: {self.error_type}: {self.message}"


class WorkerPool(Protocol):
    """How a coordinator reaches its workers."""

    def __len__(self) -> int: ...

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        """Run each ``(worker_index, method, kwargs)`` concurrently; one result per call, in order."""
        ...


class RefitFailedError(TransferError):
    """A lifecycle step failed on one or more workers; ``failures`` lists each one."""

    def __init__(self, step: str, failures: list[CallResult]) -> None:
        self.step = step
        self.failures = failures
        lines = "\n".join(f"  {f.describe()}" for f in failures)
        super().__init__(f"{step} failed on {len(failures)} worker(s):\n{lines}")


@dataclasses.dataclass(frozen=True)
class RefitReport:
    """What one successful refit did: the new version and each worker's result."""

    weight_version: int
    policy: list[dict[str, Any]]
    rollout: list[dict[str, Any]]


class RefitCoordinator:
    """Drives prepare -> init -> refits -> finalize over a pool of ``RefitWorker`` services.

    ``topology`` tells which policy rank feeds which rollout rank for verification
    (``"broadcast"`` and ``"fanout"``: policy 0 feeds all; ``"paired"``: policy i feeds rollout i).
    ``timeout_s`` bounds each lifecycle step as a whole.
    """

    def __init__(
        self,
        pool: WorkerPool,
        *,
        num_policy: int,
        num_rollout: int,
        timeout_s: float = 600.0,
        topology: Topology | str = "broadcast",
        verify: bool = True,
    ) -> None:
        if num_policy < 1 or num_rollout < 1 or len(pool) != num_policy + num_rollout:
            raise InvalidArgumentError(
                f"a pool of {num_policy} policy + {num_rollout} rollout workers is needed, got {len(pool)} workers"
            )
        self.pool = pool
        self.num_policy = num_policy
        self.num_rollout = num_rollout
        self.timeout_s = timeout_s
        self.topology = Topology.parse(topology)
        self.verify = verify
        self.weight_version = 0
        self._refits_since_init = 0
        self._ready = False

    @property
    def policy_workers(self) -> range:
        return range(self.num_policy)

    @property
    def rollout_workers(self) -> range:
        return range(self.num_policy, self.num_policy + self.num_rollout)

    def _all(self, step: str, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._checked(step, [(i, method, dict(kwargs or {})) for i in range(len(self.pool))])

    def _checked(self, step: str, calls: list[tuple[int, str, dict[str, Any]]]) -> list[Any]:
        results = self.pool.call(calls, self.timeout_s)
        failures = [r for r in results if not r.ok]
        if failures:
            raise RefitFailedError(step, failures)
        return [r.value for r in results]

    def setup(self) -> None:
        """``prepare()`` everywhere, then init every worker with the concatenated metadata."""
        metadata = self._all("prepare", "prepare")
        sizes = {"train_world_size": self.num_policy, "rollout_world_size": self.num_rollout}
        self._all("init", "init", {**sizes, "metadata": metadata})
        self._ready = True
        self._refits_since_init = 0

    def refit(self, *, weights: str | None = None, weights_params: dict[str, Any] | None = None) -> RefitReport:
        """One refit on every worker at once; raises ``RefitFailedError`` unless all succeeded.

        ``weights``/``weights_params`` replace the policy workers' weights factory for this
        refit (a ``"module:function"`` target, see :mod:`ckpt_core.orchestration.workload`).
        """
        if not self._ready:
            raise LifecycleError("call setup() (again, after a failure: recover()) before refit()")
        index = self._refits_since_init
        policy_kwargs: dict[str, Any] = {"refit_index": index}
        if weights is not None:
            policy_kwargs.update(weights=weights, weights_params=weights_params or {})
        calls = [(i, "refit", dict(policy_kwargs)) for i in self.policy_workers]
        calls += [(i, "refit", {"refit_index": index}) for i in self.rollout_workers]
        try:
            results = self._checked(f"refit {index}", calls)
        except RefitFailedError:
            self._ready = False
            raise
        policy, rollout = results[: self.num_policy], results[self.num_policy :]
        try:
            if self.verify:  # digests name what is missing, extra or different
                self._check_digests(index, policy, rollout)
            self._check_counts(index, policy, rollout)
        except RefitFailedError as rejected:
            unreached = self._discard()
            if unreached:
                raise RefitFailedError(rejected.step, [*rejected.failures, *unreached]) from None
            raise
        # Every rank has all of it: now, and only now, may rollout workers call it current.
        commit = {"weight_version": self.weight_version + 1}
        try:
            self._checked(f"committing refit {index}", [(i, "commit", dict(commit)) for i in self.rollout_workers])
        except RefitFailedError:
            self._ready = False
            raise
        self._refits_since_init += 1
        self.weight_version += 1
        return RefitReport(self.weight_version, policy, rollout)

    def _discard(self) -> list[CallResult]:
        """Tell every rollout worker that the refit it holds is rejected, so that no commit,
        from this coordinator or anyone else, can make it current; returns the workers that
        could not be told."""
        results = self.pool.call([(i, "discard", {}) for i in self.rollout_workers], self.timeout_s)
        return [r for r in results if not r.ok]

    def _source_rank(self, rollout_rank: int) -> int:
        return self.topology.source(rollout_rank)

    def _sent_to(self, policy: list[dict[str, Any]], rollout_rank: int) -> dict[str, Any]:
        """What the sender of ``rollout_rank`` sent it (``tensors``, ``digests``): its own
        record, or, for a sender with a stream per destination, that destination's part."""
        source = policy[self._source_rank(rollout_rank)]
        return source.get("by_destination", {}).get(str(rollout_rank), source)

    def _check_counts(self, index: int, policy: list[dict[str, Any]], rollout: list[dict[str, Any]]) -> None:
        """Every rollout rank must report as many tensors as its sender pulled from its weights."""
        failures = [
            CallResult.failure(
                f"rollout rank {rank}",
                "VerificationError",
                f"received {result['tensors']} tensors, its sender (policy rank {self._source_rank(rank)}) "
                f"sent {self._sent_to(policy, rank)['tensors']}",
            )
            for rank, result in enumerate(rollout)
            if result["tensors"] != self._sent_to(policy, rank)["tensors"]
        ]
        if failures:
            self._ready = False
            raise RefitFailedError(f"verifying refit {index}", failures)

    def _check_digests(self, index: int, policy: list[dict[str, Any]], rollout: list[dict[str, Any]]) -> None:
        failures = []
        for rank, result in enumerate(rollout):
            source = self._sent_to(policy, rank)["digests"]
            got = result["digests"]
            if source and not got:
                failures.append(
                    CallResult.failure(
                        f"rollout rank {rank}",
                        "VerificationError",
                        "reported no digests: its worker does not take them (build it with verification on, "
                        "e.g. VllmRollout(verify=True)), or make this coordinator with verify=False",
                    )
                )
                continue
            if list(got.items()) != list(source.items()):  # order matters, not just contents
                missing = [n for n in source if n not in got]
                extra = [n for n in got if n not in source]
                wrong = [n for n in source if n in got and got[n] != source[n]]
                order = list(got) != [n for n in source if n in got]
                failures.append(
                    CallResult.failure(
                        f"rollout rank {rank}",
                        "VerificationError",
                        f"missing {missing[:5]}, unexpected {extra[:5]}, differing {wrong[:5]}"
                        f"{', out of order' if order else ''}",
                    )
                )
        if failures:
            self._ready = False
            raise RefitFailedError(f"verifying refit {index}", failures)

    def finalize(self) -> None:
        """``finalize()`` on every worker."""
        self._ready = False
        self._all("finalize", "finalize")

    def recover(self) -> None:
        """After a failure: fresh engines on every worker, then ``setup()`` again."""
        self._ready = False
        self._all("reset", "reset")
        self.setup()
