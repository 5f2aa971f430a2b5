"""gloo_cpu between two hosts: a policy and a rollout process in two network namespaces joined
by a veth pair (10.77.0.1 and 10.77.0.2), each engine bound to its own host's address.

Proves the transport works across distinct network stacks, not only over loopback (the
rendezvous store, the token challenge and Gloo's pair connections all cross the link), that
every listening socket is on the configured address, and that cutting the link mid-refit
(``ip link set ... down``: packets stop, nothing is reset) becomes an error on both sides
within ``timeout_s`` instead of a hang.

Skipped, with the reason, where ``ip netns`` cannot be used (no iproute2, not root, or a
sandbox that forbids namespaces).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_core.orchestration.coordinator import RefitCoordinator, RefitFailedError
from ckpt_core.orchestration.worker import refit_worker_specs
from tests.reliability.rel_faults import MARKER_WAIT_S, failures_by_worker
from tests.reliability.rel_net import listening_sockets
from tests.reliability.rel_netns import NamespacedProcessPool, TwoHosts, unavailable_reason
from tests.reliability.rel_team import worker_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 10.0
MARGIN_S = 20.0
BUCKET = 64 << 10
POLICY_HOST, ROLLOUT_HOST = 0, 1


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with TwoHosts() as made:
        yield made


def test_refit_across_two_hosts_then_a_cut_link_fails_both_sides_in_bounded_time(
    hosts: TwoHosts, tmp_path: Path
) -> None:
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=1,
        bucket_size=BUCKET,
        engine_kwargs={"timeout_s": TIMEOUT_S, "auth_token": "two-hosts"},
        weights="ckpt_core.testing.weights:every_dtype",
    )
    for spec, address in zip(specs, hosts.addresses):
        spec["service"] = "tests.reliability.rel_worker:ReliabilityWorker"
        spec["engine_kwargs"] = {**spec["engine_kwargs"], "host": address}
    prefixes = [hosts.prefix(POLICY_HOST), hosts.prefix(ROLLOUT_HOST)]
    with NamespacedProcessPool(specs, labels=labels, prefixes=prefixes, env=worker_env()) as pool:
        coordinator = RefitCoordinator(pool, num_policy=1, num_rollout=1, timeout_s=120)
        coordinator.setup()
        report = coordinator.refit()  # bit-exact, checked by digest
        assert report.rollout[0]["tensors"] == len(report.policy[0]["digests"]) > 40
        policy_listens = listening_sockets(pool.pid(0))
        rollout_listens = listening_sockets(pool.pid(1))
        assert policy_listens and all(a.startswith("10.77.0.1:") for a in policy_listens), policy_listens
        assert all(a.startswith("10.77.0.2:") for a in rollout_listens), rollout_listens

        marker = tmp_path / "in-flight"
        params = {"count": 60, "nbytes": 24 << 10, "delay_s": 0.05, "mark_after": 4, "marker": str(marker)}
        cut_at: list[float] = []

        def cut_when_in_flight() -> None:
            deadline = time.monotonic() + MARKER_WAIT_S
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            hosts.cut(ROLLOUT_HOST)
            cut_at.append(time.monotonic())

        cutter = threading.Thread(target=cut_when_in_flight, daemon=True)
        cutter.start()
        with pytest.raises(RefitFailedError) as caught:
            coordinator.refit(weights="tests.reliability.rel_weights:marked", weights_params=params)
        returned = time.monotonic()
        cutter.join(MARKER_WAIT_S)
        assert marker.exists(), "the refit never got in flight"
        elapsed = returned - cut_at[0]
        assert elapsed < TIMEOUT_S + MARGIN_S, f"{elapsed:.1f}s from the cut to the failure: a hang"
        print(
            f"listening: policy {policy_listens}, rollout {rollout_listens}; "
            f"{elapsed:.1f}s after the cut:\n{caught.value}"
        )
        failures = failures_by_worker(caught.value)
        for label, peer in (("policy rank 0", "rollout rank"), ("rollout rank 0", "policy rank 0")):
            failure = failures[label]
            assert failure.error_type in ("TransferTimeoutError", "PeerLostError"), failure.describe()
            assert peer in (failure.message or ""), failure.describe()
        assert coordinator.weight_version == 1
