"""A short soak: the leak checks of ``benchmarks/soak.py`` over 20 small refits.

Same code as the 200-refit benchmark (:func:`benchmarks.soak.run_soak`), on the shared worker
processes: after the first few refits, neither process's resident memory may grow by a bucket,
its descriptor count may not change, and no /dev/shm segment may appear or be held.
"""

from __future__ import annotations

import sys

import pytest

from tests.reliability.rel_team import REPO, Team

# benchmarks/ is a folder of the repository, not an installed package (as in test_benchmarks_smoke).
sys.path.insert(0, str(REPO))

from benchmarks.soak import payload_sizes, run_soak, summary  # noqa: E402

pytestmark = pytest.mark.slow

MIB = 1 << 20
BUCKET = 2 * MIB


def test_twenty_refits_leak_no_memory_descriptors_or_shared_memory(team: Team) -> None:
    coordinator = team.coordinator(
        policy=[0],
        rollout=[1],
        backend="gloo_cpu",
        bucket_size=BUCKET,
        engine_kwargs={"timeout_s": 60},
        weights="benchmarks.soak:soak_weights",
        weights_params={"sizes": payload_sizes(8 * MIB)},
    )
    result = run_soak(coordinator, team.view([0, 1], ["policy", "rollout"]), refits=20, bucket_size=BUCKET, settle=5)
    print(summary(result))
    assert result["payload_bytes"] > 7 * MIB
    for role, check in result["checks"].items():
        assert check["rss_growth_ok"], f"{role} RSS grew {check['rss_growth_bytes'] / MIB:.1f} MiB from refit 5 to 20"
        assert check["fds_ok"], f"{role} descriptors went from {check['fds_at_settle']} to {check['fds_at_end']}"
        assert check["shm_ok"], f"{role} holds /dev/shm files: {check['shm_held']}"
    # /dev/shm as a whole is not checked here: other test runs share the machine. The benchmark checks it.
