"""verl's checkpoint-engine lifecycle between real processes, over ckpt-core backends.

Each worker builds its engine the way verl does (``import verl`` loads ckpt-verl's entry point,
``CheckpointEngineRegistry.new(backend, bucket_size=..., [is_master=...,] **engine_kwargs)``),
and the test drives a sync the way verl's ``CheckpointEngineManager.update_weights`` does:
``prepare`` on every worker (trainer ranks first), the class's ``build_topology``,
``init_process_group`` on every worker at once, ``send_weights`` beside ``receive_weights``,
``finalize`` on every worker. Three syncs, the group rebuilt each time, trainer 2 -> rollout 2
and 1 -> 2, over gloo_cpu and cuda_ipc (on the host): every tensor arrives bit for bit, and
the version a rollout receives is the trainer's ``global_steps``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed (the dev set-up pins verl==0.9.1)")

from ckpt_core.orchestration.local import LocalProcessPool

HERE = Path(__file__).resolve().parent
BUCKET = 1 << 16
TIMEOUT_S = 30.0
BACKENDS = {"ckpt_gloo_cpu": {}, "ckpt_cuda_ipc": {"device": "cpu"}}
TRAINERS, ROLLOUTS = [0, 1], [2, 3]  # worker indices in the pool


def call(pool: LocalProcessPool, method: str, per_worker: dict[int, dict[str, Any]]) -> dict[int, Any]:
    """``method`` on the given workers at once; their results by worker index."""
    results = pool.call([(index, method, kwargs) for index, kwargs in per_worker.items()], TIMEOUT_S + 30)
    failed = [result.describe() for result in results if not result.ok]
    assert not failed, "\n".join(failed)
    return {index: result.value for index, result in zip(per_worker, results)}


def rebuild(pool: LocalProcessPool, trainers: list[int], rollouts: list[int]) -> None:
    """The group, rebuilt as verl's manager does before each sync: prepare on every worker,
    the registered class's build_topology, init_process_group on every worker at once."""
    workers = trainers + rollouts
    prepared = call(pool, "prepare", dict.fromkeys(workers, {}))
    metadata = [prepared[index] for index in workers]
    topology = call(
        pool,
        "build_topology",
        {trainers[0]: {"trainers": len(trainers), "rollouts": len(rollouts), "metadata": metadata}},
    )
    trainer_kwargs, rollout_kwargs = topology[trainers[0]]
    init: dict[int, dict[str, Any]] = {}
    for group, kwargs in ((trainers, trainer_kwargs), (rollouts, rollout_kwargs)):
        assert all(len(values) == len(group) for values in kwargs.values()), "one entry per worker, as verl asserts"
        for position, index in enumerate(group):
            init[index] = {key: values[position] for key, values in kwargs.items()}
    call(pool, "init_process_group", init)


def sync(
    pool: LocalProcessPool, trainers: list[int], rollouts: list[int], global_steps: int, told: int | None = None
) -> tuple[dict[int, Any], float]:
    """One sync as verl's manager runs it; returns each worker's sync result and the seconds
    the group's rebuild took (prepare, topology, init, finalize)."""
    workers = trainers + rollouts
    start = time.perf_counter()
    rebuild(pool, trainers, rollouts)
    rebuilt = time.perf_counter() - start
    results = call(
        pool,
        "sync",
        {
            index: {"global_steps": global_steps, **({"told": told} if told is not None and index in rollouts else {})}
            for index in workers
        },
    )
    start = time.perf_counter()
    call(pool, "finalize", dict.fromkeys(workers, {}))
    return results, rebuilt + time.perf_counter() - start


@pytest.fixture(params=list(BACKENDS), scope="module")
def pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalProcessPool]:
    backend = request.param
    kwargs: dict[str, Any] = {**BACKENDS[backend], "timeout_s": TIMEOUT_S}
    if backend == "ckpt_cuda_ipc":
        kwargs["socket_dir"] = str(tmp_path_factory.mktemp("s"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    specs = [
        {
            "service": "verl_side:VerlSide",
            "backend": backend,
            "role": role,
            "rank": rank,
            "bucket_size": BUCKET,
            "engine_kwargs": kwargs,
        }
        for role, rank in (("trainer", 0), ("trainer", 1), ("rollout", 0), ("rollout", 1))
    ]
    with LocalProcessPool(specs, labels=["trainer0", "trainer1", "rollout0", "rollout1"], env=env) as workers:
        yield workers


@pytest.mark.slow
@pytest.mark.parametrize("trainers", [TRAINERS, TRAINERS[:1]], ids=["2to2", "1to2"])
def test_three_syncs_with_the_group_rebuilt_each_arrive_bit_for_bit(
    pool: LocalProcessPool, trainers: list[int]
) -> None:
    rebuilds = []
    for global_steps in (3, 4, 7):
        results, seconds = sync(pool, trainers, ROLLOUTS, global_steps)
        rebuilds.append(seconds)
        expected = call(pool, "expected", {ROLLOUTS[0]: {"global_steps": global_steps}})[ROLLOUTS[0]]
        for index in ROLLOUTS:
            assert results[index].get("received") == expected, f"rollout {index}, step {global_steps}: {results[index]}"
        assert results[trainers[0]]["metrics"]["ckpt/tensors"] == len(expected) + 1  # and the version
    print(f"group rebuild per sync (prepare, topology, init, finalize): {[f'{s * 1e3:.0f} ms' for s in rebuilds]}")


@pytest.mark.slow
def test_a_rollout_told_another_step_refuses_the_weights(pool: LocalProcessPool) -> None:
    results, _ = sync(pool, TRAINERS, ROLLOUTS, global_steps=5, told=6)
    for index in ROLLOUTS:
        assert results[index].get("error") == "WeightVersionError", results[index]
        assert "global_steps=5" in results[index]["message"] and "global_steps=6" in results[index]["message"]
    results, _ = sync(pool, TRAINERS, ROLLOUTS, global_steps=8)  # the next sync, group rebuilt, is whole
    expected = call(pool, "expected", {ROLLOUTS[0]: {"global_steps": 8}})[ROLLOUTS[0]]
    assert all(results[index].get("received") == expected for index in ROLLOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [ROLLOUTS[1], TRAINERS[0]], ids=["rollout-killed", "trainer-killed"])
def test_a_killed_worker_is_a_typed_error_in_time_and_the_next_sync_is_whole(
    pool: LocalProcessPool, victim: int
) -> None:
    """Killed mid-sync, a rollout or the sending trainer: every surviving worker of the transfer
    ends in a typed transfer error within timeout_s (trainer rank 1, which sends to no one,
    drains its generator unharmed); verl's next sync (the worker replaced, the group rebuilt)
    arrives bit for bit."""
    workers = TRAINERS + ROLLOUTS
    rebuild(pool, TRAINERS, ROLLOUTS)
    outcome: dict[int, Any] = {}

    def run() -> None:
        kwargs = {"global_steps": 9, "delay_s": 0.05}
        results = pool.call([(index, "sync", kwargs) for index in workers], TIMEOUT_S + 30)
        outcome.update({index: result for index, result in zip(workers, results)})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.0)  # the sync is under way (48 weights, 50 ms apart)
    killed_at = time.monotonic()
    pool.kill(victim)
    thread.join(TIMEOUT_S + 60)
    assert not thread.is_alive()
    for index in workers:
        if index == victim:
            assert not outcome[index].ok
            continue
        report = outcome[index].value
        if index == TRAINERS[1]:  # sends to no one in the broadcast topology: it drains, unharmed
            assert report == {"metrics": {}}, report
            continue
        assert report.get("error") in ("PeerLostError", "TransferTimeoutError", "RemoteRefitError"), (index, report)
        assert report["at"] - killed_at < TIMEOUT_S + 10, f"worker {index} took {report['at'] - killed_at:.1f}s"
    pool.restart(victim)  # a supervisor's replacement
    results, _ = sync(pool, TRAINERS, ROLLOUTS, global_steps=10)
    expected = call(pool, "expected", {ROLLOUTS[0]: {"global_steps": 10}})[ROLLOUTS[0]]
    assert all(results[index].get("received") == expected for index in ROLLOUTS), results
