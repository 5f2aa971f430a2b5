"""verl's own ``CheckpointEngineManager`` syncs ckpt-core engines between Ray actors.

Everything verl runs here is verl's: the manager (``update_weights``: abort and release on the
replicas, the rollout group built from the replicas' workers, ``prepare`` / ``build_topology``
/ ``init_process_group`` on every worker, the send beside the receive, ``finalize``, resume),
``CheckpointEngineWorker`` (the rollout side, building its engine from a ``RolloutConfig``),
``RayWorkerGroup`` and ``RayResourcePool`` (CPU bundles). The actor workers are
:class:`ckpt_verl.testing.WeightsTrainer` (the checkpoint-engine part of verl's actor worker)
and each replica's adapter records what it was handed (:class:`ckpt_verl.testing.RecordingAdapter`),
since verl's own train on GPUs and launch servers. Two replicas of one worker each; the trainer
group sends with 2 ranks, then 1 (a group of rank 0's actor alone), then 2 again: the group is
rebuilt at every sync, as verl's manager does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed (the dev set-up pins verl==0.9.1)")
ray = pytest.importorskip("ray")

from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineWorker  # noqa: E402
from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402

from ckpt_core.errors import PeerLostError, RemoteRefitError, TransferTimeoutError  # noqa: E402
from ckpt_verl.engine import WeightVersionError  # noqa: E402
from ckpt_verl.testing import (  # noqa: E402
    SHAPES,
    RecordingAdapter,
    StandInReplica,
    WeightsTrainer,
    digest,
    recorded,
    seeded_weights,
)

TIMEOUT_S = 30.0
BACKENDS = {"ckpt_gloo_cpu": {}, "ckpt_cuda_ipc": {"device": "cpu"}}
TRANSFER_ERRORS = (PeerLostError, TransferTimeoutError, RemoteRefitError)
GATHER_S = TIMEOUT_S + 60  # a sync's every worker answers within its engine's timeout_s, and Ray's own


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    # Logical CPUs: verl's resource pools ask for one CPU bundle per worker (four per backend,
    # and their replacements); the processes share the machine's cores.
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def recorded_or_nothing(directory: Path, rank: int, global_steps: int) -> dict[str, Any]:
    try:
        return recorded(directory, rank, global_steps)
    except FileNotFoundError:
        return {}


def pid(actor: Any) -> int:
    """The process of a Ray actor (this machine's: the cluster is local)."""
    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=GATHER_S))


def wait_dead(process: int, deadline: float) -> None:
    """Wait until ``process`` has exited (gone, or a zombie its parent has not reaped: its
    sockets are closed either way), until ``deadline`` (``time.monotonic()``)."""
    status = Path(f"/proc/{process}/status")
    while time.monotonic() < deadline:
        try:
            state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
        except (FileNotFoundError, ProcessLookupError):
            return
        if "zombie" in state:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {process} was killed and has not exited")


def ended_outcome(trainer: Any) -> dict[str, Any]:
    """A trainer's last sync's outcome once it ended (``{}`` while it runs)."""
    outcome: dict[str, Any] = ray.get(trainer.last_outcome.remote(), timeout=GATHER_S)
    return outcome if "at" in outcome else {}


def pool(workers: int) -> RayResourcePool:
    return RayResourcePool([workers], use_gpu=False, max_colocate_count=1)


class Setup:
    """verl's parts for one backend: a trainer group of two ranks and two replicas of one
    ``CheckpointEngineWorker`` each, each replica's adapter recording into ``directory``.
    Every test of the module uses them in turn (each sync its own ``global_steps``), replacing
    what it kills."""

    def __init__(self, backend: str, directory: Path) -> None:
        options: dict[str, Any] = {**BACKENDS[backend], "timeout_s": TIMEOUT_S}
        if backend == "ckpt_cuda_ipc":
            options["socket_dir"] = str(directory)
        self.config = CheckpointEngineConfig(
            backend=backend, update_weights_bucket_megabytes=1, engine_kwargs={backend: options}
        )
        self.rollout_config = RolloutConfig(name="vllm", checkpoint_engine=self.config, tensor_model_parallel_size=1)
        self.directory = directory
        self.tensors = len(SHAPES)
        self.trainers = self.trainer_group()
        self.replicas = [self.replica(rank) for rank in range(2)]

    def trainer_group(self) -> RayWorkerGroup:
        trainer = RayClassWithInitArgs(cls=ray.remote(WeightsTrainer), config=self.config)
        return RayWorkerGroup(resource_pool=pool(2), ray_cls_with_init=trainer, use_gpu=False)

    def replica(self, rank: int) -> StandInReplica:
        worker = RayClassWithInitArgs(
            cls=ray.remote(CheckpointEngineWorker),
            rollout_config=self.rollout_config,
            model_config=None,
            server_adapter=RecordingAdapter(self.directory, replica_rank=rank),
            replica_rank=rank,
        )
        return StandInReplica(RayWorkerGroup(resource_pool=pool(1), ray_cls_with_init=worker, use_gpu=False).workers)

    def rank0_alone(self) -> RayWorkerGroup:
        """A trainer group of rank 0's actor alone (verl's group over existing workers)."""
        return RayWorkerGroup(
            worker_handles=self.trainers.workers[:1],
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(WeightsTrainer)),
        )

    def pace(self, tensors: int = len(SHAPES), hold_after: int | None = None) -> None:
        self.trainers.set_pace(tensors=tensors, hold_after=hold_after)
        self.tensors = tensors

    def manager(self, trainers: RayWorkerGroup | None = None) -> CheckpointEngineManager:
        return CheckpointEngineManager(self.config, trainers or self.trainers, list(self.replicas))

    def assert_delivered(self, global_steps: int) -> None:
        expected = {name: digest(tensor) for name, tensor in seeded_weights(global_steps, tensors=self.tensors)}
        for rank in range(len(self.replicas)):
            assert recorded(self.directory, rank, global_steps) == expected, f"replica {rank}, step {global_steps}"

    def close(self) -> None:
        for worker in self.trainers.workers + [w for replica in self.replicas for w in replica.workers]:
            ray.kill(worker)


@pytest.fixture(params=list(BACKENDS), scope="module")
def setup(
    request: pytest.FixtureRequest, ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    parts = Setup(request.param, tmp_path_factory.mktemp("adapters"))
    yield parts
    parts.close()


@pytest.mark.slow
def test_verls_manager_syncs_three_steps_rebuilding_the_group_each_time(setup: Setup) -> None:
    for global_steps, trainers in ((1, None), (2, setup.rank0_alone()), (3, None)):
        metrics = setup.manager(trainers).update_weights(global_steps=global_steps)
        setup.assert_delivered(global_steps)
        assert metrics["ckpt/tensors"] == setup.tensors + 1  # and the version
    for replica in setup.replicas:  # generation stopped and restarted around each sync
        assert replica.calls == dict.fromkeys(
            ("abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation"), 3
        )


@pytest.mark.slow
def test_a_rollout_told_another_step_refuses_the_weights_and_the_next_sync_is_whole(setup: Setup) -> None:
    """verl's parts driven as the manager drives them, the rollouts told step 6 while the
    trainers send step 5 (a manager never does this; a bug that did must not install the wrong
    step's weights under this step's number)."""
    rollout = RayWorkerGroup(
        worker_handles=[w for replica in setup.replicas for w in replica.workers],
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker)),
    )
    manager = setup.manager()
    manager.build_process_group(rollout)
    sent = setup.trainers.update_weights(global_steps=5)
    received = rollout.update_weights(global_steps=6)
    for ref in received:
        with pytest.raises(WeightVersionError, match="global_steps=5.*global_steps=6"):
            ray.get(ref, timeout=GATHER_S)
    for ref in sent:  # the sender learns of the refusal where its transport tells (a closed receiver)
        with contextlib.suppress(*TRANSFER_ERRORS):
            ray.get(ref, timeout=GATHER_S)
    # No finalize (verl's manager re-raises without it): the next sync's prepare() ends the old group.
    manager.update_weights(global_steps=8)
    setup.assert_delivered(8)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["rollout", "trainer"])
def test_a_killed_worker_fails_the_sync_in_time_and_the_next_is_whole(setup: Setup, victim: str) -> None:
    """A trainer's sync (200 weights, four 1 MiB buckets) loses a rollout worker or the
    sending trainer rank (SIGKILL) mid-send: the trainers hold their weights after the fifth,
    before the first bucket is posted, until the victim is dead (a hold, not a delay: a busy
    machine cannot let the send finish first). verl's ``update_weights`` raises at once: Ray's
    error for the lost actor, or a survivor's typed transfer error, whichever Ray hears of first.
    Every surviving worker of the transfer (the other rollout, or both; the sender) ends in a
    typed transfer error within timeout_s. verl then replaces the lost workers
    (``remove_replicas`` / ``add_replicas``, or a new trainer group) and the next sync is whole."""
    step = {"rollout": 20, "trainer": 30}[victim]
    setup.pace(tensors=200, hold_after=5)
    manager = setup.manager()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            manager.update_weights(global_steps=step)
        except Exception as exc:  # noqa: BLE001 - the test's to check
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    sender = setup.trainers.workers[0]
    deadline = time.monotonic() + GATHER_S
    while True:
        outcome_now = ray.get(sender.last_outcome.remote(), timeout=GATHER_S)
        if outcome_now.get("global_steps") == step and outcome_now["held"]:
            break
        assert "at" not in outcome_now or outcome_now.get("global_steps") != step, outcome_now
        assert time.monotonic() < deadline, "the sync never reached the trainer's hold"
        time.sleep(0.05)
    victim_pid = pid(setup.replicas[1].workers[0] if victim == "rollout" else sender)
    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)  # at once (ray.kill only asks Ray to)
    wait_dead(victim_pid, killed_at + GATHER_S)
    time.sleep(0.5)  # the survivors' transports see its sockets closed before the send goes on
    survivors = setup.trainers.workers[1:] if victim == "trainer" else setup.trainers.workers
    ray.get([worker.release_hold.remote() for worker in survivors], timeout=GATHER_S)
    thread.join(GATHER_S)
    assert not thread.is_alive(), "verl's update_weights did not return"
    # Ray's gather raises at the first failed worker it hears of: the killed actor's death, or a
    # survivor's typed transfer error when its closed socket is seen before Ray's death notice.
    error = outcome.get("error")
    assert isinstance(error, (ray.exceptions.RayActorError, *TRANSFER_ERRORS)), repr(error)
    reports: dict[str, Callable[[], dict[str, Any]]] = {
        f"replica {rank}": functools.partial(recorded_or_nothing, setup.directory, rank, step)
        for rank in ((0,) if victim == "rollout" else (0, 1))
    }
    if victim == "rollout":  # trainer rank 0 sends; rank 1 drains its generator, sending to no one
        reports["trainer 0"] = lambda: ended_outcome(sender)
    deadline = killed_at + TIMEOUT_S + 10
    for who, report in reports.items():
        while not (ended := report()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ended.get("error") in {cls.__name__ for cls in TRANSFER_ERRORS}, (who, ended)
        assert ended["at"] < deadline, f"{who} ended {ended['at'] - killed_at:.1f}s after the kill"

    if victim == "rollout":
        lost, setup.replicas[1] = setup.replicas[1], setup.replica(1)
        manager.remove_replicas([lost])
        manager.add_replicas([setup.replicas[1]])
        setup.pace()
    else:
        for worker in setup.trainers.workers[1:]:
            ray.kill(worker)
        setup.trainers = setup.trainer_group()
        setup.tensors = len(SHAPES)
        manager = setup.manager()
    manager.update_weights(global_steps=step + 1)
    setup.assert_delivered(step + 1)
