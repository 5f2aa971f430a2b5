"""What is gloo_cpu's own, end to end: real processes, real Gloo groups, every refit checked by
digest. The refits every transport must get right (dtypes, sizes, topologies, draining ranks,
repeated refits) are the conformance kit's, run here by test_gloo_cpu_conformance.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.transport.torch_distributed import HEADER_FRAME_BYTES

BUCKET = 64 << 10  # small, so every case spans several buckets
W = "ckpt_core.testing.weights:"


@pytest.mark.parametrize("topology", ["broadcast", "fanout"])
def test_headers_longer_than_one_frame(topology: str) -> None:
    """Long names make each bucket's header larger than the fixed-size header frame, so the
    rest of it travels as a message of its own, after the frame (a broadcast's frame alone; a
    pair's with the packed payload in it). The refits the conformance kit runs on this backend,
    test_gloo_cpu_conformance.py beside this file, all fit their frame."""
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={"timeout_s": 60, "topology": topology},
        weights=W + "tiny",
    )
    params = {"count": 300, "nbytes": 8, "name_length": HEADER_FRAME_BYTES // 100}
    with LocalProcessPool(specs, labels=labels) as pool:
        coord = RefitCoordinator(pool, num_policy=1, num_rollout=2, timeout_s=120, topology=topology)
        coord.setup()
        report = coord.refit(weights=W + "tiny", weights_params=params)
        coord.finalize()
    assert all(r["tensors"] == 300 for r in report.rollout)


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
