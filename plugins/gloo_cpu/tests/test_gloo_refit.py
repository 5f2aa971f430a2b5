"""gloo_cpu end to end: real processes, real Gloo groups, every refit checked by digest."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from ckpt_core.orchestration.coordinator import RefitCoordinator, RefitFailedError
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.transport.torch_distributed import HEADER_FRAME_BYTES

BUCKET = 64 << 10  # small, so every case spans several buckets
W = "ckpt_core.testing.weights:"

SHAPES = [
    pytest.param(("broadcast", 1, 2), id="broadcast-1to2"),
    pytest.param(("paired", 2, 2), id="paired-2to2"),
    pytest.param(("paired", 3, 1), id="paired-3to1"),
    pytest.param(("broadcast", 2, 2), id="broadcast-2to2"),
]


@pytest.fixture(scope="module", params=SHAPES)
def coordinator(request: pytest.FixtureRequest):
    topology, num_policy, num_rollout = request.param
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=num_policy,
        num_rollout=num_rollout,
        bucket_size=BUCKET,
        engine_kwargs={"topology": topology, "timeout_s": 60},
        weights=W + "every_dtype",
    )
    with LocalProcessPool(specs, labels=labels) as pool:
        coord = RefitCoordinator(pool, num_policy=num_policy, num_rollout=num_rollout, topology=topology, timeout_s=120)
        coord.setup()
        yield coord
        coord.finalize()


def test_every_dtype_and_edge_tensors(coordinator: RefitCoordinator) -> None:
    report = coordinator.refit(weights=W + "every_dtype", weights_params={"seed": 1})
    for result in report.rollout:
        assert result["tensors"] == len(report.policy[0]["digests"]) > 40
        assert "empty.float32" in result["digests"] and "scalar.bool" in result["digests"]


def test_tensors_larger_than_the_bucket(coordinator: RefitCoordinator) -> None:
    sizes = [10 * BUCKET, 3, BUCKET + 1, 0, BUCKET - 1, 2 * BUCKET]
    report = coordinator.refit(weights=W + "sized", weights_params={"sizes": sizes})
    assert report.rollout[0]["stats"]["buckets"] >= 15
    itemsizes = itertools.cycle((4, 2, 1))  # the dtypes `sized` cycles through
    assert report.rollout[0]["stats"]["payload_bytes"] == sum(s // i * i for s, i in zip(sizes, itemsizes))


def test_ten_thousand_tiny_tensors(coordinator: RefitCoordinator) -> None:
    report = coordinator.refit(weights=W + "tiny", weights_params={"count": 10_000, "nbytes": 12})
    assert all(r["tensors"] == 10_000 for r in report.rollout)


def test_headers_longer_than_one_frame(coordinator: RefitCoordinator) -> None:
    """Long names make each bucket's header larger than the fixed-size header frame, so the
    rest of it travels as a message of its own."""
    params = {"count": 300, "nbytes": 8, "name_length": HEADER_FRAME_BYTES // 100}
    report = coordinator.refit(weights=W + "tiny", weights_params=params)
    assert all(r["tensors"] == 300 for r in report.rollout)


def test_generator_that_yields_nothing(coordinator: RefitCoordinator) -> None:
    report = coordinator.refit(weights=W + "nothing")
    assert all(r["tensors"] == 0 for r in report.rollout)
    assert report.rollout[0]["stats"]["buckets"] == 1  # the empty, last bucket


def test_five_refits_with_changing_values(coordinator: RefitCoordinator) -> None:
    seen = []
    for _ in range(5):
        report = coordinator.refit(weights=W + "every_dtype", weights_params={"seed": 7, "elements": 1000})
        seen.append(report.rollout[0]["digests"]["dtype.float32"])
    assert len(set(seen)) == 5, "values must differ from one refit to the next"


def test_paired_ranks_are_not_mixed_up() -> None:
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=2,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={"topology": "paired", "timeout_s": 60},
        weights=W + "rank_dependent",
    )
    with LocalProcessPool(specs, labels=labels) as pool:
        coord = RefitCoordinator(pool, num_policy=2, num_rollout=2, topology="paired", timeout_s=120)
        coord.setup()
        report = coord.refit()
        assert report.rollout[0]["digests"] != report.rollout[1]["digests"]
        # Checking rollout 1 against policy 0 must fail: the check itself can tell ranks apart.
        coord.topology = "broadcast"
        with pytest.raises(RefitFailedError, match="rollout rank 1"):
            coord.refit()


@pytest.mark.parametrize("with_default_group", [False, True])
def test_the_callers_default_process_group_is_untouched(with_default_group: bool) -> None:
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={"timeout_s": 60},
        weights=W + "every_dtype",
    )
    for spec in specs:
        spec["service"] = "default_group_worker:DefaultGroupWorker"
        spec["with_default_group"] = with_default_group
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    with LocalProcessPool(specs, labels=labels, env=env) as pool:
        coord = RefitCoordinator(pool, num_policy=1, num_rollout=2, timeout_s=120)
        coord.setup()
        coord.refit()
        coord.finalize()
        states = [r.value for r in pool.call([(i, "default_group_state", {}) for i in range(3)], 30)]
    expected = (
        {"initialized": True, "world_size": 1, "backend": "gloo"} if with_default_group else {"initialized": False}
    )
    assert states == [expected] * 3
