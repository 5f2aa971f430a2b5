"""``JoinedPool``: two pools driven as one by a coordinator (how the vLLM adapter joins a
trainer's processes and an engine's ranks), with real worker processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from ckpt_core.orchestration.coordinator import CallResult, RefitCoordinator, RefitFailedError
from ckpt_core.orchestration.joined import JoinedPool
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs

WEIGHTS = "ckpt_core.bench.synthetic:transformer_weights"


@pytest.fixture(scope="module")
def pools() -> Any:
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=1,
        bucket_size=1 << 20,
        weights=WEIGHTS,
        weights_params={"size_bytes": 2 << 20, "seed": 3},
    )
    with (
        LocalProcessPool(specs[:1], labels=labels[:1]) as policy,
        LocalProcessPool(specs[1:], labels=labels[1:]) as rollout,
    ):
        yield policy, rollout


def test_a_coordinator_refits_across_two_joined_pools_and_commits_on_rollout_workers(pools: Any) -> None:
    policy, rollout = pools
    coordinator = RefitCoordinator(JoinedPool(policy, rollout), num_policy=1, num_rollout=1, timeout_s=60)
    coordinator.setup()
    try:
        for version in (1, 2):
            report = coordinator.refit()
            assert report.weight_version == version
            assert report.rollout[0]["digests"] == report.policy[0]["digests"]
            # Each refit's report carries the version committed before it: the rollout
            # worker heard the commit, the policy worker was not asked.
            assert report.rollout[0]["weight_version"] == version - 1
            assert report.policy[0]["weight_version"] == 0
    finally:
        coordinator.finalize()


class _Raising:
    def __len__(self) -> int:
        return 2

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        raise TimeoutError("the engine did not answer")


def test_a_part_that_raises_fails_only_its_own_calls(pools: Any) -> None:
    policy, _ = pools
    joined = JoinedPool(policy, _Raising())
    assert len(joined) == 3
    results = joined.call([(0, "prepare", {}), (1, "prepare", {}), (2, "prepare", {})], 30)
    assert results[0].ok
    assert [r.error_type for r in results[1:]] == ["TimeoutError", "TimeoutError"]
    assert all("did not answer" in (r.message or "") for r in results[1:])
    with pytest.raises(IndexError, match="not in a joined pool of 3"):
        joined.call([(3, "prepare", {})], 1)
    coordinator = RefitCoordinator(joined, num_policy=1, num_rollout=2, timeout_s=30)
    with pytest.raises(RefitFailedError, match="did not answer"):
        coordinator.setup()
