"""``Team``: worker processes shared by the reliability tests, re-purposed per test.

Starting a Python process that imports torch costs several CPU-seconds on the 2-core CI
machine, so the tests share a few :class:`~rel_worker.ReliabilityWorker` processes: each test
configures the ones it needs (backend, role, rank, options) and builds a
:class:`~ckpt_core.orchestration.coordinator.RefitCoordinator` over them. A test that kills a process calls
:meth:`Team.replace` (a fresh process, started now); any process found dead is replaced before
it is configured again.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckpt_core.orchestration.coordinator import CallResult, RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SERVICE = {"service": "tests.reliability.rel_worker:ReliabilityWorker"}
START_TIMEOUT_S = 300.0  # process start under a loaded 2-core machine can take a minute


def worker_env() -> dict[str, str]:
    """This environment with the repository root on ``PYTHONPATH``: workers import the fault
    engines and the worker service as ``tests.reliability.*``, and ``benchmarks``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


class Team:
    """``size`` worker processes addressed by slot number ``0..size-1``."""

    def __init__(self, size: int) -> None:
        self._env = worker_env()
        self._pools: list[LocalProcessPool] = []
        self._where: list[tuple[LocalProcessPool, int]] = []
        self._started = 0
        self._configs: dict[int, dict[str, Any]] = {}  # slot -> its last configure() kwargs
        self._where = self._start(size)

    def _start(self, count: int) -> list[tuple[LocalProcessPool, int]]:
        labels = [f"process#{self._started + i}" for i in range(count)]
        self._started += count
        pool = LocalProcessPool([SERVICE] * count, labels=labels, env=self._env, start_timeout_s=START_TIMEOUT_S)
        self._pools.append(pool)
        return [(pool, i) for i in range(count)]

    def __len__(self) -> int:
        return len(self._where)

    def pid(self, slot: int) -> int:
        pool, index = self._where[slot]
        return pool.pid(index)

    def kill(self, slot: int, sig: int = signal.SIGKILL) -> None:
        pool, index = self._where[slot]
        pool.kill(index, sig)

    def replace(self, slots: Sequence[int]) -> None:
        """Give each of ``slots`` a fresh process (one start for all of them), configured as
        its predecessor last was."""
        if not slots:
            return
        for slot in slots:
            if _alive(self.pid(slot)):
                self.kill(slot)
        for slot, where in zip(slots, self._start(len(slots))):
            self._where[slot] = where
        self.configure([(slot, self._configs[slot]) for slot in slots if slot in self._configs])

    def configure(self, configs: Sequence[tuple[int, dict[str, Any]]], timeout_s: float = 120.0) -> None:
        """``ReliabilityWorker.configure(**kwargs)`` on each ``(slot, kwargs)``."""
        results = self.call([(slot, "configure", kwargs) for slot, kwargs in configs], timeout_s)
        failed = [r.describe() for r in results if not r.ok]
        assert not failed, "configuring workers failed:\n" + "\n".join(failed)
        self._configs.update(configs)

    def replace_dead(self, slots: Sequence[int]) -> None:
        self.replace([s for s in slots if not _alive(self.pid(s))])

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        """``LocalProcessPool.call`` across the pools the slots live in, concurrently."""
        by_pool: dict[int, list[tuple[int, tuple[int, str, dict[str, Any]]]]] = {}
        for position, (slot, method, kwargs) in enumerate(calls):
            pool, index = self._where[slot]
            by_pool.setdefault(id(pool), []).append((position, (index, method, kwargs)))
        results: list[CallResult | None] = [None] * len(calls)

        def run(entries: list[tuple[int, tuple[int, str, dict[str, Any]]]]) -> None:
            pool = self._where[calls[entries[0][0]][0]][0]
            for (position, _), result in zip(entries, pool.call([c for _, c in entries], timeout_s)):
                results[position] = result

        groups = list(by_pool.values())
        threads = [threading.Thread(target=run, args=(entries,)) for entries in groups[1:]]
        for thread in threads:
            thread.start()
        if groups:
            run(groups[0])
        for thread in threads:
            thread.join()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def view(self, slots: Sequence[int], labels: Sequence[str]) -> View:
        return View(self, list(slots), list(labels))

    def coordinator(
        self,
        *,
        policy: Sequence[int],
        rollout: Sequence[int],
        backend: str,
        bucket_size: int,
        engine_kwargs: dict[str, Any] | None = None,
        weights: str = "ckpt_core.testing.weights:every_dtype",
        weights_params: dict[str, Any] | None = None,
        verify: bool = True,
        trail_dir: Path | None = None,
        topology: str = "broadcast",
        call_timeout_s: float = 120.0,
    ) -> RefitCoordinator:
        """Configure the slots (policy ranks, then rollout ranks) and return a coordinator
        over them. ``trail_dir``: rollout rank ``r`` logs each tensor to ``trail_dir/rollout<r>``."""
        slots = [*policy, *rollout]
        self.replace_dead(slots)
        common = dict(backend=backend, bucket_size=bucket_size, engine_kwargs=engine_kwargs, verify=verify)
        configs: list[tuple[int, dict[str, Any]]] = []
        for rank, slot in enumerate(policy):
            configs.append(
                (slot, dict(common, role="policy", rank=rank, weights=weights, weights_params=weights_params))
            )
        for rank, slot in enumerate(rollout):
            trail = str(trail_dir / f"rollout{rank}") if trail_dir is not None else None
            configs.append((slot, dict(common, role="rollout", rank=rank, trail_path=trail)))
        self.configure(configs, call_timeout_s)
        labels = [f"policy rank {r}" for r in range(len(policy))] + [f"rollout rank {r}" for r in range(len(rollout))]
        return RefitCoordinator(
            self.view(slots, labels),
            num_policy=len(policy),
            num_rollout=len(rollout),
            timeout_s=call_timeout_s,
            topology=topology,
            verify=verify,
        )

    def close(self) -> None:
        pools, self._pools = self._pools, []
        for pool in pools:
            pool.close()


@dataclasses.dataclass
class View:
    """Some slots of a team, in coordinator order, under role labels: a ``WorkerPool``."""

    team: Team
    slots: list[int]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.slots)

    def pid(self, index: int) -> int:
        return self.team.pid(self.slots[index])

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        results = self.team.call([(self.slots[i], m, k) for i, m, k in calls], timeout_s)
        return [self._relabel(result, self.labels[i]) for result, (i, _, _) in zip(results, calls)]

    @staticmethod
    def _relabel(result: CallResult, label: str) -> CallResult:
        message = result.message
        if message is not None:
            message = message.replace(result.worker, label)
        return dataclasses.replace(result, worker=label, message=message)
