"""Faults during a refit, between real processes, through the local coordinator.

For gloo_cpu and cuda_ipc (host buffers): a SIGKILLed rollout, a SIGKILLed policy, and a
policy whose weights generator raises. Each failure must be loud (every rank's call fails with
a typed error naming the peer and what it was doing), bounded (the coordinator returns within
``timeout_s`` plus a margin; a hang would take the coordinator's own limit, minutes), must not
advance ``weight_version``, must never hand a partial or altered tensor to a rollout, and must
be recoverable: fresh engines in the survivors, a fresh process for the dead one, and the next
refit is bit-exact.

The time bounds are correctness properties (no hang), not speed targets: ``MARGIN_S`` is
generous because the CI machine has two cores shared by several test runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_core.orchestration.coordinator import RefitCoordinator, RefitFailedError
from tests.reliability.rel_faults import Striker, clear, failures_by_worker, read_trail, slow_source
from tests.reliability.rel_team import Team

pytestmark = pytest.mark.slow

BUCKET = 64 << 10
TIMEOUT_S = 10.0
MARGIN_S = 20.0
P, R0, R1 = 0, 1, 2
SLOW = {"count": 60, "nbytes": 24 << 10, "delay_s": 0.05, "mark_after": 4}

BACKENDS = [
    pytest.param(("gloo_cpu", {}), id="gloo_cpu"),
    pytest.param(("cuda_ipc", {"device": "cpu"}), id="cuda_ipc-cpu"),
]


def start(
    team: Team, backend: tuple[str, dict[str, Any]], trails: Path, timeout_s: float = TIMEOUT_S
) -> RefitCoordinator:
    """1 policy -> 2 rollouts, set up, with one bit-exact refit done (weight_version 1)."""
    name, options = backend
    coordinator = team.coordinator(
        policy=[P],
        rollout=[R0, R1],
        backend=name,
        bucket_size=BUCKET,
        engine_kwargs={**options, "timeout_s": timeout_s},
        trail_dir=trails,
    )
    coordinator.setup()
    report = coordinator.refit()
    assert report.weight_version == coordinator.weight_version == 1
    return coordinator


def recover_and_check(coordinator: RefitCoordinator, version_before: int) -> None:
    """After a failure: the next refit is refused until recovery, then bit-exact."""
    with pytest.raises(RuntimeError, match="recover"):
        coordinator.refit()
    coordinator.recover()
    report = coordinator.refit(weights="ckpt_core.testing.weights:every_dtype", weights_params={"seed": 3})
    assert report.weight_version == version_before + 1
    assert all(r["tensors"] == len(report.policy[0]["digests"]) > 40 for r in report.rollout)


def assert_only_whole_source_tensors(trail: Path, params: dict[str, Any], refit_index: int) -> None:
    """Whatever a rollout was handed during the failed refit is a whole tensor of the source,
    bit-exact (its digest covers dtype, shape and bytes)."""
    source = slow_source(params, refit_index)
    handed = read_trail(trail)
    wrong = {n: d for n, d in handed.items() if source.get(n) != d}
    assert not wrong, f"a rollout was handed tensors that differ from the source: {sorted(wrong)[:5]}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_rollout_fails_every_rank_in_bounded_time_then_recovers(
    team: Team, backend: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    coordinator = start(team, backend, tmp_path)
    clear(tmp_path / "rollout0")
    params = {**SLOW, "marker": str(tmp_path / "in-flight")}
    striker = Striker(team, R1, tmp_path / "in-flight")
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights="tests.reliability.rel_weights:marked", weights_params=params)
    elapsed = striker.seconds_since_strike()
    assert elapsed < TIMEOUT_S + MARGIN_S, f"the refit took {elapsed:.1f}s to fail after the kill: a hang"

    print(f"{elapsed:.1f}s after the kill:\n{caught.value}")
    failures = failures_by_worker(caught.value)
    assert set(failures) == {"policy rank 0", "rollout rank 0", "rollout rank 1"}, caught.value
    policy = failures["policy rank 0"]
    assert policy.error_type in ("PeerLostError", "TransferTimeoutError"), policy.describe()
    if backend[0] == "gloo_cpu":
        # One broadcast reaches every rollout; Gloo reports the broken connection, not a rank.
        assert "sending a bucket with rollout ranks 0..1" in (policy.message or ""), policy.describe()
    else:
        assert "rollout rank 1" in (policy.message or "") and " while " in (policy.message or ""), policy.describe()
    survivor = failures["rollout rank 0"]
    assert survivor.error_type in ("PeerLostError", "TransferTimeoutError", "RemoteRefitError"), survivor.describe()
    assert "SIGKILL" in (failures["rollout rank 1"].message or "")
    assert coordinator.weight_version == 1
    assert_only_whole_source_tensors(tmp_path / "rollout0", params, refit_index=1)

    team.replace([R1])
    recover_and_check(coordinator, version_before=1)
    coordinator.finalize()


@pytest.mark.parametrize("backend", [BACKENDS[1]])
def test_a_rollout_killed_before_the_last_bucket_fails_the_survivor_too(
    team: Team, backend: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A rollout killed while the weights come, seconds before the refit's last bucket is
    posted, is found before any rollout has that bucket's header, so the survivor does not
    complete a refit that failed. Over cuda_ipc it did: the last header went to rank 0, then
    failed at rank 1 (the policy had read rank 1's release of the bucket before, not its end).
    Not over gloo_cpu: a Gloo broadcast to a lost rank fails only when waited on, after the
    others have the bucket, so a survivor can complete there (1 run in 7)."""
    coordinator = start(team, backend, tmp_path)
    params = {"count": 6, "nbytes": 4 << 10, "delay_s": 0.6, "mark_after": 1, "marker": str(tmp_path / "in-flight")}
    striker = Striker(team, R1, tmp_path / "in-flight")
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights="tests.reliability.rel_weights:marked", weights_params=params)
    striker.seconds_since_strike()
    failures = failures_by_worker(caught.value)
    assert set(failures) == {"policy rank 0", "rollout rank 0", "rollout rank 1"}, caught.value
    survivor = failures["rollout rank 0"]
    assert survivor.error_type in ("PeerLostError", "RemoteRefitError"), survivor.describe()
    assert coordinator.weight_version == 1
    team.replace([R1])
    recover_and_check(coordinator, version_before=1)
    coordinator.finalize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_policy_fails_every_rollout_without_partial_tensors_then_recovers(
    team: Team, backend: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    coordinator = start(team, backend, tmp_path)
    for rank in (0, 1):
        clear(tmp_path / f"rollout{rank}")
    params = {**SLOW, "marker": str(tmp_path / "in-flight")}
    striker = Striker(team, P, tmp_path / "in-flight")
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights="tests.reliability.rel_weights:marked", weights_params=params)
    elapsed = striker.seconds_since_strike()
    assert elapsed < TIMEOUT_S + MARGIN_S, f"the refit took {elapsed:.1f}s to fail after the kill: a hang"

    print(f"{elapsed:.1f}s after the kill:\n{caught.value}")
    failures = failures_by_worker(caught.value)
    # No rollout reports success: none of them may load a refit that did not complete.
    assert set(failures) == {"policy rank 0", "rollout rank 0", "rollout rank 1"}, caught.value
    assert "SIGKILL" in (failures["policy rank 0"].message or "")
    for rank in (0, 1):
        failure = failures[f"rollout rank {rank}"]
        assert failure.error_type in ("PeerLostError", "TransferTimeoutError"), failure.describe()
        assert "policy rank 0" in (failure.message or ""), failure.describe()
        assert_only_whole_source_tensors(tmp_path / f"rollout{rank}", params, refit_index=1)
    assert coordinator.weight_version == 1

    team.replace([P])
    recover_and_check(coordinator, version_before=1)
    coordinator.finalize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_generator_error_fails_rollouts_at_once_with_its_message(
    team: Team, backend: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    timeout_s = 60.0  # so that a refit that waited for its timeout could not pass the bound below
    coordinator = start(team, backend, tmp_path, timeout_s=timeout_s)
    began = time.monotonic()
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit(weights="ckpt_core.testing.weights:failing", weights_params={"after": 40, "elements": 4096})
    elapsed = time.monotonic() - began
    print(f"{elapsed:.1f}s after the refit began:\n{caught.value}")
    failures = failures_by_worker(caught.value)
    assert failures["policy rank 0"].error_type == "RuntimeError"
    for rank in (0, 1):
        failure = failures[f"rollout rank {rank}"]
        assert failure.error_type == "RemoteRefitError", failure.describe()
        assert "weights generator failed on purpose" in (failure.message or ""), failure.describe()
    assert elapsed < timeout_s / 2, f"receivers took {elapsed:.1f}s to learn of the failure: they waited it out"
    assert coordinator.weight_version == 1
    recover_and_check(coordinator, version_before=1)
    coordinator.finalize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_after_a_failed_refit_releases_every_socket(
    team: Team, backend: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """finalize() releases the transport's sockets at once, also after a failed refit (whose
    traceback, a reference cycle, may still point at the transport objects): a trainer that
    recovers from many failures must not accumulate connections until a garbage collection."""
    coordinator = start(team, backend, tmp_path)
    slots = [P, R0, R1]
    coordinator.finalize()
    baseline = [r.value for r in team.call([(s, "socket_count", {}) for s in slots], 60)]
    coordinator.setup()
    with pytest.raises(RefitFailedError):
        coordinator.refit(weights="ckpt_core.testing.weights:failing", weights_params={"after": 40, "elements": 4096})
    coordinator.finalize()
    after = [r.value for r in team.call([(s, "socket_count", {}) for s in slots], 60)]
    assert after == baseline, (
        f"sockets open per worker (policy, rollout 0, rollout 1): {baseline} before setup, {after} after "
        "a failed refit and finalize()"
    )
