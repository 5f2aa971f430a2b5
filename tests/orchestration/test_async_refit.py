"""The engine's coroutines never block the event loop, and cancelling them ends a refit cleanly.

Real worker processes (one per side, :class:`~ckpt_core.orchestration.local.LocalProcessPool`)
and real engines, over gloo_cpu and over cuda_ipc with host buffers:

* during a 256 MiB refit, a coroutine ticking every 10 ms on the same loop as the refit, on
  the policy and on the rollout side, never waits more than 50 ms between ticks;
* cancelling the task awaiting ``send_weights`` fails the engine, joins its thread and gives
  the rollout ``RemoteRefitError`` at once (not after its ``timeout_s``);
* a consumer that stops (``aclose()``) or whose ``__anext__`` is cancelled fails the engine,
  joins its thread, and its sender fails at once with a typed error.

The services below run inside the worker processes (the repository root is on their ``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_core.errors import LifecycleError
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.registry import create_checkpoint_engine

Weights = Generator[tuple[str, torch.Tensor], None, None]

pytestmark = pytest.mark.slow

TICK_S = 0.010
MAX_GAP_S = 0.050
REFIT_BYTES = 256 << 20
TENSOR_BYTES = 16 << 20
BUCKET = 32 << 20
TIMEOUT_S = 60.0  # far above every bound checked here: a peer that times out fails the test
PROMPT_S = 10.0  # how soon a peer must hear of a cancelled refit (loaded 2-core machine)

BACKENDS = [
    pytest.param(("gloo_cpu", {}), id="gloo_cpu"),
    pytest.param(("cuda_ipc", {"device": "cpu"}), id="cuda_ipc-cpu"),
]


# --- what runs in the worker processes ------------------------------------------------------


class _Ticker:
    """Ticks every ``TICK_S`` on the running loop; the largest gap between two ticks."""

    def __init__(self) -> None:
        self.max_gap_s = 0.0
        self.max_gap_cpu_s = 0.0  # this process's CPU time during the largest gap (diagnostic:
        # near zero means the process was not scheduled, not that the loop was blocked)
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    def __enter__(self) -> _Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.process_time()
        while True:
            await asyncio.sleep(TICK_S)
            now, cpu = time.perf_counter(), time.process_time()
            if now - last > self.max_gap_s:
                self.max_gap_s, self.max_gap_cpu_s = now - last, cpu - last_cpu
            self.ticks += 1
            last, last_cpu = now, cpu


def _weights(refit_index: int, count: int, delay_s: float = 0.0) -> Weights:
    """``count`` float32 tensors of ``TENSOR_BYTES``; tensor ``i`` holds ``i + refit_index``
    except for its first element, ``-i`` (the receiver checks both ends)."""
    for i in range(count):
        if delay_s:
            time.sleep(delay_s)
        tensor = torch.full((TENSOR_BYTES // 4,), float(i + refit_index))
        tensor[0] = -i
        yield f"layer{i:03d}.weight", tensor


def _check(name: str, tensor: torch.Tensor, refit_index: int) -> None:
    i = int(name[5:8])
    if tensor.numel() != TENSOR_BYTES // 4 or tensor[0] != -i or tensor[-1] != i + refit_index:
        raise AssertionError(f"{name} arrived wrong: {tensor.numel()} elements, ends {tensor[0]}, {tensor[-1]}")


def _refit_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ckpt-refit"))


class AsyncSide:
    """One engine in a worker process, refits driven on an event loop of this process."""

    def __init__(self, *, role: str, backend: str, engine_kwargs: dict[str, Any]) -> None:
        self.role = role
        self.engine = create_checkpoint_engine(backend, bucket_size_bytes=BUCKET, engine_kwargs=engine_kwargs)

    def prepare(self) -> Any:
        return self.engine.prepare()

    def init(self, *, metadata: list[Any]) -> None:
        if self.role == "policy":
            self.engine.init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
            )
        else:
            self.engine.init_rollout_process_group(
                rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
            )

    def finalize(self) -> None:
        self.engine.finalize()

    # -- a refit beside a ticking coroutine

    def ticking_refit(self, *, refit_index: int) -> dict[str, Any]:
        return asyncio.run(self._ticking_refit(refit_index))

    async def _ticking_refit(self, refit_index: int) -> dict[str, Any]:
        # The trainer's weights exist before its refit: made here, outside the measured time.
        weights = list(_weights(refit_index, REFIT_BYTES // TENSOR_BYTES)) if self.role == "policy" else []
        start = time.perf_counter()
        with _Ticker() as ticker:
            if self.role == "policy":
                await self.engine.send_weights(weight for weight in weights)
                received = 0
            else:
                received = 0
                async for batch in self.engine.receive_weight_batches():
                    for name, tensor in batch:
                        _check(name, tensor, refit_index)
                        received += tensor.numel() * tensor.element_size()
        return {
            "max_gap_s": ticker.max_gap_s,
            "max_gap_cpu_s": ticker.max_gap_cpu_s,
            "ticks": ticker.ticks,
            "seconds": time.perf_counter() - start,
            "received_bytes": received,
        }

    # -- cancellation

    def cancelled_refit(self, *, how: str, after: int) -> dict[str, Any]:
        """Start this side's refit and stop it after ``after`` weights (policy: the task is
        cancelled) or batches (rollout: ``how`` is ``"aclose"`` or ``"cancel"``, the latter
        cancelling the task while it awaits the next batch)."""
        return asyncio.run(self._cancelled_refit(how, after))

    async def _cancelled_refit(self, how: str, after: int) -> dict[str, Any]:
        before = _refit_threads()
        progress = 0  # weights pulled (policy) or batches taken (rollout)

        def weights() -> Weights:
            nonlocal progress
            for item in _weights(0, 200, delay_s=0.02):
                progress += 1
                yield item

        batches = self.engine.receive_weight_batches()

        async def consume() -> None:
            nonlocal progress
            async for _ in batches:
                progress += 1
                if progress == after and how == "aclose":
                    await batches.aclose()
                    return

        if self.role == "policy":
            task = asyncio.get_running_loop().create_task(self.engine.send_weights(weights()))
        else:
            task = asyncio.get_running_loop().create_task(consume())
        while progress < after and not task.done():
            await asyncio.sleep(0.002)
        stopped_at = time.monotonic()
        if how == "cancel":
            task.cancel()
        outcome = "completed"
        try:
            await asyncio.wait_for(task, TIMEOUT_S)
        except asyncio.CancelledError:
            outcome = "CancelledError"
        took_s = time.monotonic() - stopped_at
        after_threads = _refit_threads()
        try:  # the engine is failed: a refit is refused until finalize() and a new setup
            if self.role == "policy":
                await self.engine.send_weights(weight for weight in _weights(0, 0))
            else:
                async for _ in self.engine.receive_weight_batches():
                    pass
            state = "usable"
        except LifecycleError as exc:
            state = str(exc)
        return {
            "outcome": outcome,
            "stopped_at": stopped_at,
            "took_s": took_s,
            "threads_before": before,
            "threads_after": after_threads,
            "state": state,
        }

    def plain_refit(self, *, slow: bool = False) -> dict[str, Any]:
        """This side of a refit, driven to its end or its error: the error's type and when
        (``time.monotonic()``, comparable across processes) it was raised."""

        async def run() -> None:
            if self.role == "policy":
                await self.engine.send_weights(_weights(0, 200, delay_s=0.02 if slow else 0.0))
            else:
                async for _ in self.engine.receive_weight_batches():
                    pass

        try:
            asyncio.run(run())
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": type(exc).__name__, "message": str(exc), "at": time.monotonic()}
        return {"error": None, "at": time.monotonic()}


# --- the tests ------------------------------------------------------------------------------


def _pool(backend: tuple[str, dict[str, Any]], import_root: Path, short_tmp: Path) -> LocalProcessPool:
    name, options = backend
    kwargs: dict[str, Any] = {**options, "timeout_s": TIMEOUT_S}
    if name == "cuda_ipc":
        kwargs["socket_dir"] = str(short_tmp)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(import_root), env.get("PYTHONPATH")]))
    service = "tests.orchestration.test_async_refit:AsyncSide"
    specs = [
        {"service": service, "role": role, "backend": name, "engine_kwargs": kwargs} for role in ("policy", "rollout")
    ]
    return LocalProcessPool(specs, labels=["policy", "rollout"], env=env)


def _call(pool: LocalProcessPool, method: str | list[str], *kwargs: dict[str, Any]) -> list[Any]:
    """``method`` on both workers at once (or ``[policy's, rollout's]``), each with its kwargs."""
    methods = method if isinstance(method, list) else [method, method]
    per_worker = kwargs or ({}, {})
    calls = [(i, m, dict(k)) for i, (m, k) in enumerate(zip(methods, per_worker))]
    results = pool.call(calls, TIMEOUT_S + 60)
    failed = [r.describe() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return [r.value for r in results]


def _setup(pool: LocalProcessPool) -> None:
    metadata = _call(pool, "prepare")
    _call(pool, "init", {"metadata": metadata}, {"metadata": metadata})


@pytest.mark.alone  # a 50 ms bound: measured with the machine to itself (see make test)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_ticking_coroutine_on_either_side_keeps_its_pace_during_a_256_mib_refit(
    backend: tuple[str, dict[str, Any]], import_root: Path, short_tmp: Path
) -> None:
    pool = _pool(backend, import_root, short_tmp)
    try:
        _setup(pool)
        for refit_index in range(2):  # the second replays the first's packing
            policy, rollout = _call(pool, "ticking_refit", {"refit_index": refit_index}, {"refit_index": refit_index})
            print(
                f"{backend[0]} refit {refit_index}: policy max gap {policy['max_gap_s'] * 1e3:.1f} ms "
                f"(process CPU in it {policy['max_gap_cpu_s'] * 1e3:.1f} ms; {policy['ticks']} ticks, "
                f"{policy['seconds']:.2f}s), rollout max gap {rollout['max_gap_s'] * 1e3:.1f} ms (process CPU "
                f"in it {rollout['max_gap_cpu_s'] * 1e3:.1f} ms; {rollout['ticks']} ticks, {rollout['seconds']:.2f}s)"
            )
            assert rollout["received_bytes"] == REFIT_BYTES
            assert policy["ticks"] >= 3 and rollout["ticks"] >= 3, "the refit was too short to measure"
            assert policy["max_gap_s"] <= MAX_GAP_S, f"the policy's loop stalled {policy['max_gap_s']:.3f}s"
            assert rollout["max_gap_s"] <= MAX_GAP_S, f"the rollout's loop stalled {rollout['max_gap_s']:.3f}s"
        _call(pool, "finalize")
    finally:
        pool.close()


CANCELLATIONS = [
    pytest.param(("policy", "cancel"), id="policy-task-cancelled"),
    pytest.param(("rollout", "aclose"), id="rollout-aclose"),
    pytest.param(("rollout", "cancel"), id="rollout-anext-cancelled"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stopping", CANCELLATIONS)
def test_a_cancelled_refit_fails_the_engine_joins_its_thread_and_fails_the_peer_at_once(
    backend: tuple[str, dict[str, Any]], stopping: tuple[str, str], import_root: Path, short_tmp: Path
) -> None:
    side, how = stopping
    pool = _pool(backend, import_root, short_tmp)
    try:
        _setup(pool)
        stop = {"how": how, "after": 3}
        if side == "policy":
            stopped, peer = _call(pool, ["cancelled_refit", "plain_refit"], stop, {})
            peer_errors: tuple[str, ...] = ("RemoteRefitError",)
        else:
            peer, stopped = _call(pool, ["plain_refit", "cancelled_refit"], {"slow": True}, stop)
            peer_errors = ("PeerLostError", "RemoteRefitError")
        print(f"{backend[0]}, {side} {how}: {stopped}\npeer: {peer}")
        assert stopped["outcome"] == ("CancelledError" if how == "cancel" else "completed")
        assert stopped["took_s"] < PROMPT_S, f"stopping took {stopped['took_s']:.1f}s"
        assert stopped["threads_after"] == stopped["threads_before"] == [], "a refit thread outlived its refit"
        assert "failed" in stopped["state"], stopped["state"]
        assert peer["error"] in peer_errors, peer
        heard_after = peer["at"] - stopped["stopped_at"]
        assert heard_after < PROMPT_S, f"the peer heard of it {heard_after:.1f}s later (timeout_s={TIMEOUT_S:g})"
        _call(pool, "finalize")
    finally:
        pool.close()
