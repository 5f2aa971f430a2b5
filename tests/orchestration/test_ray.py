"""Refits between Ray actors on a local Ray cluster (one cluster for the whole module).

Real actors, real Gloo groups between them: 1 policy -> 2 rollout (broadcast) and 2 -> 2
(paired), bit-exact over several refits; an actor killed mid-refit becomes one error naming
it; a call past its deadline fails instead of hanging; the RL-loop example runs end to end.
Actors ask for no CPU so that four fit on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from ckpt_core import cli  # noqa: E402
from ckpt_core.errors import EngineOptionError  # noqa: E402
from ckpt_core.orchestration.coordinator import RefitFailedError  # noqa: E402
from ckpt_core.orchestration.ray import RayRefitCoordinator, RayWorkerPool, RefitActor  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
Actor = ray.remote(num_cpus=0)(RefitActor)


def gloo_config(**engine_kwargs: Any) -> dict[str, Any]:
    return {
        "backend": "gloo_cpu",
        "bucket_size_bytes": 4096,
        "engine_kwargs": {"timeout_s": 60.0, **engine_kwargs},
        "weights": "ckpt_core.testing.weights:every_dtype",
        "weights_params": {"seed": 3, "elements": 300},
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster; yields its address (for subprocesses that join it)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def actors(cluster: str) -> Iterator[list[Any]]:
    """Four bare refit actors, reused (reconfigured) by the tests: two policy, two rollout.
    The last is an async actor (Ray runs its ``ckpt_call`` on its event loop's thread)."""

    class AsyncRefitActor(RefitActor):
        async def ping(self) -> bool:
            return True

        def loop_is_running(self) -> bool:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return False
            return True

    handles = [Actor.remote() for _ in range(3)] + [ray.remote(num_cpus=0)(AsyncRefitActor).remote()]
    yield handles
    for handle in handles:
        ray.kill(handle)


def test_broadcast_one_policy_to_two_rollout_actors_bit_exact(actors: list[Any]) -> None:
    policy, rollout = actors[:1], actors[2:]
    coordinator = RayRefitCoordinator(policy, rollout, gloo_config(topology="broadcast"), timeout_s=120)
    node_ip = ray.util.get_node_ip_address()
    assert [w["engine_kwargs"]["host"] for w in coordinator.workers] == [node_ip] * 3
    assert node_ip != "127.0.0.1"
    coordinator.setup()
    try:
        seen = []
        for expected_version in (1, 2, 3):
            report = coordinator.refit()
            assert report.weight_version == expected_version
            source = report.policy[0]["digests"]
            assert len(source) > 10
            assert [r["digests"] for r in report.rollout] == [source, source]
            seen.append(source)
        assert seen[0] != seen[1] != seen[2]  # each refit moved new values
    finally:
        coordinator.finalize()


def test_paired_two_to_two_bit_exact(actors: list[Any]) -> None:
    config = gloo_config(topology="paired")
    config.update(weights="ckpt_core.testing.weights:rank_dependent", weights_params={"count": 5, "elements": 777})
    coordinator = RayRefitCoordinator(actors[:2], actors[2:], config, timeout_s=120)
    assert coordinator.topology == "paired"
    assert ray.get(actors[3].loop_is_running.remote(), timeout=60)  # rollout rank 1 is an async actor
    coordinator.setup()
    try:
        for expected_version in (1, 2, 3):
            report = coordinator.refit()
            assert report.weight_version == expected_version
            assert report.rollout[0]["digests"] == report.policy[0]["digests"]
            assert report.rollout[1]["digests"] == report.policy[1]["digests"]
            assert report.rollout[0]["digests"] != report.rollout[1]["digests"]
    finally:
        coordinator.finalize()


def test_bad_config_and_bad_actors_are_refused_with_names(actors: list[Any]) -> None:
    with pytest.raises(EngineOptionError, match="bucket_size"):
        RayRefitCoordinator(actors[:1], actors[2:], {"backend": "gloo_cpu", "bucket_size": 1})
    with pytest.raises(TypeError, match="policy rank 0: expected a Ray actor handle"):
        RayRefitCoordinator([object()], actors[2:], gloo_config())
    # A policy actor with neither weights() nor a weights factory, and an unknown option:
    # each actor's own error, by role, rank and actor id.
    config = gloo_config(no_such_option=1)
    del config["weights"]
    with pytest.raises(RefitFailedError) as failed:
        RayRefitCoordinator(actors[:1], actors[2:3], config)
    text = str(failed.value)
    assert "configure failed on 2 worker(s)" in text
    assert f"policy rank 0 (Ray actor {actors[0]._actor_id.hex()}): ValueError: RefitActor has no weights" in text
    assert f"rollout rank 0 (Ray actor {actors[2]._actor_id.hex()}): EngineOptionError" in text
    assert "no_such_option" in text


def test_a_call_past_its_deadline_fails_instead_of_hanging(actors: list[Any]) -> None:
    config = gloo_config(timeout_s=30.0)
    config.update(weights="ckpt_core.testing.weights:slow", weights_params={"count": 6, "nbytes": 64, "delay_s": 0.5})
    coordinator = RayRefitCoordinator(actors[:1], actors[2:3], config, timeout_s=60)
    coordinator.setup()
    coordinator.timeout_s = 1.0
    with pytest.raises(RefitFailedError) as failed:
        coordinator.refit()
    assert coordinator.weight_version == 0
    assert {f.error_type for f in failed.value.failures} == {"TimeoutError"}
    assert "did not answer refit() within 1s" in str(failed.value)
    # The actors finish the refit they were running; the next calls wait their turn, then work.
    coordinator.timeout_s = 60.0
    coordinator.recover()
    coordinator.finalize()


def test_rl_loop_example_runs(cluster: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # One rollout actor: each one imports transformers (the costly part on a 2-core machine).
    command = [sys.executable, str(REPO / "examples" / "ray_rl_loop.py"), "--address", cluster, "--rollout", "1"]
    run = subprocess.run(
        command + ["--steps", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("rollout logits == policy logits") == 3, run.stdout
    assert "before the first refit, rollout logits differ" in run.stdout


def test_bench_command_runs_on_ray(cluster: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Ray is already initialized here, so the bench joins this cluster and leaves it running.
    argv = [
        "bench",
        "--launcher",
        "ray",
        "--size",
        "1MiB",
        "--bucket-size",
        "256KiB",
        "--rollout",
        "1",
        "--refits",
        "1",
        "--no-baseline",
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "gloo_cpu broadcast 1->1" in out and "bit-exact: every received tensor matched its source" in out
    assert ray.is_initialized()


def test_an_actor_killed_mid_refit_is_one_error_naming_it(actors: list[Any]) -> None:
    victim = actors[1]  # last test of the module: the fixture's actors are done with after it
    config = gloo_config(topology="broadcast", timeout_s=6.0)
    slow = {"count": 40, "nbytes": 1024, "delay_s": 0.2}
    config.update(weights="ckpt_core.testing.weights:slow", weights_params=slow)
    coordinator = RayRefitCoordinator(actors[:1], [actors[2], victim], config, timeout_s=120)
    victim_label = f"rollout rank 1 (Ray actor {victim._actor_id.hex()})"
    coordinator.setup()
    outcome: dict[str, BaseException] = {}

    def refit() -> None:
        try:
            coordinator.refit()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=refit)
    thread.start()
    time.sleep(2.0)  # the refit takes >= 8 s (40 tensors, 0.2 s apart): it is under way
    ray.kill(victim)
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, RefitFailedError), error
    assert coordinator.weight_version == 0
    died = [f for f in error.failures if f.worker == victim_label]
    assert len(died) == 1 and (died[0].error_type or "").endswith("ActorDiedError")
    message = died[0].message or ""
    assert f"{victim_label}: " in str(error) and "died" in message and "ray.kill" in message
    # The dead actor fails every later call at once, by name (the survivors are reset).
    dead = r"rollout rank 1 .*: ActorDiedError: the actor died, reset\(\) did not complete"
    with pytest.raises(RefitFailedError, match=dead) as again:
        coordinator.recover()
    assert [f.worker for f in again.value.failures] == [victim_label]
    RayWorkerPool(actors[:1] + actors[2:3], ["policy rank 0", "rollout rank 0"]).call(
        [(0, "finalize", {}), (1, "finalize", {})], 60
    )
