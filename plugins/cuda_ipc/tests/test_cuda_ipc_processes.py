"""cuda_ipc (``device="cpu"``) between real processes, driven by ckpt_core's local coordinator.

Every refit is checked bit-exact by the coordinator (per-tensor digests of the sender's source
against what each rollout received). Cleanup is checked from outside each worker, through
``/proc/<pid>``: after ``finalize()`` no worker maps the slot file or holds a socket or memfd
descriptor, and nothing new is left in ``/dev/shm`` or in the socket directory, also after a
peer was SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cuda_ipc_helpers import coordinator_for, descriptors, slot_mappings, transport_descriptors

from ckpt_core.orchestration.coordinator import RefitCoordinator, RefitFailedError
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs

BUCKET = 8192
WEIGHTS = "ckpt_core.testing.weights:"
CALL_TIMEOUT_S = 60.0
TIMEOUT_S = 4.0  # the engines' timeout_s: short, since the last test waits it out on purpose
# Names that this plugin, Python's multiprocessing or torch would give a /dev/shm segment. Other
# engineers' tests run beside these and may create their own names meanwhile; what our workers
# map is checked exactly, through /proc (see slot_mappings).
SHM_PREFIXES = ("ckpt-cuda-ipc", "cuda_ipc", "psm_", "torch_", "sem.")


def _left_in_shm(before: set[str], settle_s: float = 5.0) -> list[str]:
    """Segments named as ours might be, made since ``before`` and still there after
    ``settle_s``: a test running beside these makes and removes its own meanwhile (seen:
    ``psm_`` and ``sem.mp-`` names gone a moment later), where a leak of ours stays."""
    deadline = time.monotonic() + settle_s
    while True:
        left = sorted(n for n in set(os.listdir("/dev/shm")) - before if n.startswith(SHM_PREFIXES))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


class Workers:
    """Policy ranks 0, 1 (workers 0, 1) and rollout ranks 0, 1 (workers 2, 3) running cuda_ipc
    on host buffers, with the descriptor count each had before any engine was used."""

    P0, P1, R0, R1 = range(4)

    def __init__(self, pool: LocalProcessPool) -> None:
        self.pool = pool
        self.baseline = {i: len(descriptors(pool.pid(i))) for i in range(len(pool))}

    def coordinator(self, policy: list[int], rollout: list[int]) -> RefitCoordinator:
        return coordinator_for(self.pool, policy, rollout, CALL_TIMEOUT_S)

    def pid(self, index: int) -> int:
        return self.pool.pid(index)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Policy ranks 0, 1 and rollout ranks 0, 1, shared by this module's tests (worker start-up
    dominates their time). The last test kills some of them. At the end nothing may be left in
    /dev/shm or in the socket directory."""
    socket_dir = tmp_path_factory.mktemp("sockets")
    shm_before = set(os.listdir("/dev/shm"))
    specs, labels = refit_worker_specs(
        backend="cuda_ipc",
        num_policy=2,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={"device": "cpu", "timeout_s": TIMEOUT_S, "socket_dir": str(socket_dir)},
        weights=WEIGHTS + "every_dtype",
    )
    with LocalProcessPool(specs, labels=labels) as pool:
        yield Workers(pool)
    left = _left_in_shm(shm_before)
    assert not left, f"left in /dev/shm: {left}"
    assert os.listdir(socket_dir) == [], "control sockets or directories were left behind"


def assert_released(pool: LocalProcessPool, indices: range | list[int], baseline: dict[int, int]) -> None:
    for index in indices:
        pid = pool.pid(index)
        assert slot_mappings(pid) == [], f"worker {index} still maps the slots"
        assert transport_descriptors(pid) == [], f"worker {index} still holds {transport_descriptors(pid)}"
        assert len(descriptors(pid)) == baseline[index], f"worker {index}: {descriptors(pid)}"


def failures_by_worker(error: RefitFailedError) -> dict[str, Any]:
    return {f.worker: f for f in error.failures}


def kill_later(
    pool: LocalProcessPool, index: int, delay_s: float, sig: int = signal.SIGKILL
) -> tuple[threading.Timer, list[float]]:
    """Send ``sig`` to worker ``index`` after ``delay_s``; the list gets the time it was sent."""
    sent: list[float] = []

    def fire() -> None:
        pool.kill(index, sig)
        sent.append(time.monotonic())

    timer = threading.Timer(delay_s, fire)
    timer.start()
    return timer, sent


def test_one_to_one_every_dtype_five_refits_then_clean(group: Workers) -> None:
    coordinator = group.coordinator([group.P0], [group.R0])
    coordinator.setup()
    assert slot_mappings(group.pid(group.P0)) and slot_mappings(group.pid(group.R0)), "both map the slot file"
    digests = []
    for _ in range(5):
        report = coordinator.refit()  # raises unless every tensor arrived bit-exact
        received = report.rollout[0]
        assert received["tensors"] == len(report.policy[0]["digests"]) >= 40
        assert received["stats"]["buckets"] > 2
        digests.append(received["digests"])
    for before, after in zip(digests, digests[1:]):
        changed = [name for name in before if before[name] != after[name]]
        assert len(changed) > len(before) // 2, "values must change between refits"
    large = coordinator.refit(weights=WEIGHTS + "sized", weights_params={"sizes": [5 * BUCKET + 12, 3 * BUCKET, 0, 1]})
    assert large.rollout[0]["tensors"] == 4 and large.rollout[0]["stats"]["buckets"] >= 9
    coordinator.finalize()
    assert_released(group.pool, [group.P0, group.R0], group.baseline)


def test_one_policy_process_feeds_two_rollouts(group: Workers) -> None:
    coordinator = group.coordinator([group.P0], [group.R0, group.R1])
    coordinator.setup()
    for _ in range(2):
        report = coordinator.refit()
        assert [r["tensors"] for r in report.rollout] == [len(report.policy[0]["digests"])] * 2
    coordinator.refit(weights=WEIGHTS + "sized", weights_params={"sizes": [4 * BUCKET + 2, 2 * BUCKET + 6]})
    coordinator.finalize()
    assert_released(group.pool, range(4), group.baseline)


def test_other_policy_ranks_drain_and_hold_nothing(group: Workers) -> None:
    coordinator = group.coordinator([group.P0, group.P1], [group.R0, group.R1])
    coordinator.setup()
    assert transport_descriptors(group.pid(group.P1)) == [] and slot_mappings(group.pid(group.P1)) == []
    report = coordinator.refit()
    assert report.policy[1]["stats"] is None  # it sent nothing
    assert all(r["tensors"] == len(report.policy[0]["digests"]) for r in report.rollout)
    coordinator.finalize()
    assert_released(group.pool, range(4), group.baseline)


def test_dead_and_stuck_peers_fail_fast_and_leave_nothing(group: Workers) -> None:
    """One set of processes, failing in turn: a SIGKILLed rollout, a frozen rollout, a
    SIGKILLed policy. Every failure is a typed error naming the peer, well within timeout_s."""
    timeout_s = TIMEOUT_S
    slow = {"count": 100, "nbytes": BUCKET // 2, "delay_s": 0.05}
    pool = group.pool

    # 1. Rollout rank 1 is SIGKILLed mid-refit.
    coordinator = group.coordinator([group.P0], [group.R0, group.R1])
    coordinator.setup()
    coordinator.refit()
    timer, sent = kill_later(pool, group.R1, delay_s=1.0)
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights=WEIGHTS + "slow", weights_params=slow)
    returned = time.monotonic()
    timer.join()
    assert returned - sent[0] < timeout_s + 5
    failures = failures_by_worker(caught.value)
    assert failures["policy rank 0"].error_type == "PeerLostError", failures["policy rank 0"].describe()
    assert "rollout rank 1" in failures["policy rank 0"].message
    assert "SIGKILL" in failures["rollout rank 1"].message
    # The surviving rollout is told at once instead of waiting out its timeout.
    assert failures["rollout rank 0"].error_type == "RemoteRefitError"
    assert all(r.ok for r in pool.call([(group.P0, "finalize", {}), (group.R0, "finalize", {})], CALL_TIMEOUT_S))
    assert_released(pool, [group.P0, group.R0], group.baseline)

    # 2. Rollout rank 0 freezes (SIGSTOP): the policy must give up by itself. The rollout is
    # resumed only timeout_s + 6 s later, so a refit that still succeeded would mean it did not.
    # The policy's wait starts when it next needs a slot the rollout holds, which on a loaded
    # machine came more than 2 s after the stop: the resumed rollout then closed its end first
    # (seen once in CI, PeerLostError instead of the timeout).
    coordinator = group.coordinator([group.P0], [group.R0])
    coordinator.recover()
    stop, _ = kill_later(pool, group.R0, delay_s=0.5, sig=signal.SIGSTOP)
    resume, _ = kill_later(pool, group.R0, delay_s=0.5 + timeout_s + 6, sig=signal.SIGCONT)
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights=WEIGHTS + "slow", weights_params=slow)
    stop.join()
    resume.join()
    failures = failures_by_worker(caught.value)
    policy_failure = failures["policy rank 0"]
    assert policy_failure.error_type == "TransferTimeoutError", policy_failure.describe()
    assert "rollout rank 0" in policy_failure.message and f"timeout_s={timeout_s:g}" in policy_failure.message
    assert failures["rollout rank 0"].error_type == "RemoteRefitError"

    # 3. The policy is SIGKILLed mid-refit.
    coordinator.recover()
    coordinator.refit()
    timer, sent = kill_later(pool, group.P0, delay_s=1.0)
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights=WEIGHTS + "slow", weights_params=slow)
    returned = time.monotonic()
    timer.join()
    assert returned - sent[0] < timeout_s + 5
    failures = failures_by_worker(caught.value)
    assert failures["rollout rank 0"].error_type == "PeerLostError", failures["rollout rank 0"].describe()
    assert "policy rank 0" in failures["rollout rank 0"].message
    assert pool.call([(group.R0, "finalize", {})], CALL_TIMEOUT_S)[0].ok
    assert_released(pool, [group.R0], group.baseline)
