"""Integrity: corruption in flight is caught by the checksum, and a refit counts as complete
only when every rollout rank received every tensor.

The faults come from ``fault_engines`` (test-only subclasses of the real gloo_cpu engine):
one bit flipped in a received bucket, or a receiver that silently drops its last batch.
"""

from __future__ import annotations

import time

import pytest

from ckpt_core.orchestration.coordinator import RefitFailedError
from tests.reliability.rel_faults import failures_by_worker
from tests.reliability.rel_team import Team

pytestmark = pytest.mark.slow

BUCKET = 64 << 10
P, R0 = 0, 1
SIZES = {"sizes": [3 * BUCKET, BUCKET // 2, 2 * BUCKET + 4]}  # several full buckets
OPTIONS = {"timeout_s": 10, "checksum": True}  # the policy waits this long after its rollout failed (see below)


def test_a_flipped_bit_in_flight_raises_integrity_error_on_the_receiver(team: Team) -> None:
    coordinator = team.coordinator(
        policy=[P],
        rollout=[R0],
        backend="tests.reliability.fault_engines:CorruptingGlooEngine",
        bucket_size=BUCKET,
        engine_kwargs={**OPTIONS, "corrupt_bucket": 1},
        weights="ckpt_core.testing.weights:sized",
        weights_params=SIZES,
    )
    coordinator.setup()
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit()
    failure = failures_by_worker(caught.value)["rollout rank 0"]
    assert failure.error_type == "IntegrityError", failure.describe()
    assert "bucket 1 of refit 0 is corrupt" in (failure.message or "") and "checksum" in (failure.message or "")
    assert coordinator.weight_version == 0
    coordinator.finalize()


def test_a_receiver_side_failure_ends_the_senders_refit_promptly(team: Team) -> None:
    """When a rollout voids the refit (here: a checksum mismatch), the policy must learn of it
    at once, as a policy whose generator fails tells its rollouts, instead of waiting out
    timeout_s (300 s by default) for a receiver that has stopped receiving."""
    timeout_s = 12.0
    coordinator = team.coordinator(
        policy=[P],
        rollout=[R0],
        backend="tests.reliability.fault_engines:CorruptingGlooEngine",
        bucket_size=BUCKET,
        engine_kwargs={"timeout_s": timeout_s, "corrupt_bucket": 1, "checksum": True},
        weights="ckpt_core.testing.weights:sized",
        weights_params={"sizes": [12 * BUCKET]},
    )
    coordinator.setup()
    began = time.monotonic()
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit()
    elapsed = time.monotonic() - began
    coordinator.finalize()
    policy = failures_by_worker(caught.value).get("policy rank 0")
    assert policy is not None, "the policy reported success for a refit its rollout voided"
    assert elapsed < timeout_s / 2, (
        f"the policy learnt of the rollout's failure only after {elapsed:.1f}s "
        f"(timeout_s={timeout_s:g}): {policy.describe()}"
    )


def test_without_checksums_the_same_corruption_reaches_the_caller(team: Team) -> None:
    """What checksums are for: with them off, the engine hands the corrupt tensor to
    the caller as a successful refit; only the coordinator's digest check (verify=True, a
    test-time cost most deployments do not pay) notices."""
    coordinator = team.coordinator(
        policy=[P],
        rollout=[R0],
        backend="tests.reliability.fault_engines:CorruptingGlooEngine",
        bucket_size=BUCKET,
        engine_kwargs={**OPTIONS, "corrupt_bucket": 1, "checksum": False},
        weights="ckpt_core.testing.weights:sized",
        weights_params=SIZES,
    )
    coordinator.setup()
    with pytest.raises(RefitFailedError) as caught:
        coordinator.refit()
    assert caught.value.step == "verifying refit 0", "the engine itself must not have noticed"
    (failure,) = caught.value.failures
    assert failure.worker == "rollout rank 0" and failure.error_type == "VerificationError"
    assert "differing ['sized.0']" in (failure.message or ""), failure.describe()
    assert coordinator.weight_version == 0
    # The rejected refit was discarded on the rollout: no commit can make it current now.
    (late,) = coordinator.pool.call([(1, "commit", {"weight_version": 1})], 30.0)
    assert not late.ok and late.error_type == "LifecycleError", late.describe()
    assert "discarded" in (late.message or ""), late.describe()
    coordinator.finalize()


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_refit_missing_tensors_on_a_rollout_is_not_complete(team: Team, verify: bool) -> None:
    """A receiver that silently drops its last batch finishes its refit without an error; the
    coordinator must still not count the refit as complete, with or without digests."""
    coordinator = team.coordinator(
        policy=[P],
        rollout=[R0],
        backend="tests.reliability.fault_engines:TruncatingGlooEngine",
        bucket_size=BUCKET,
        engine_kwargs=OPTIONS,
        weights="ckpt_core.testing.weights:sized",
        weights_params=SIZES,
        verify=verify,
    )
    coordinator.setup()
    with pytest.raises(RefitFailedError, match="rollout rank 0"):
        coordinator.refit()
    assert coordinator.weight_version == 0
    coordinator.finalize()
