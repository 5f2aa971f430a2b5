"""cuda_ipc with ``device="cuda"``: policy and rollouts as separate processes on one GPU.

Run by ``scripts/gpu_check.sh`` (``pytest -m gpu``). Skipped without a CUDA device, and
without cupy (``pip install 'ckpt-cuda-ipc[cuda12]'`` or ``[cuda13]``), which this mode needs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cuda_ipc_helpers import coordinator_for, env_with_helpers

from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("cupy") is None,
        reason="device='cuda' needs cupy: pip install 'ckpt-cuda-ipc[cuda12]' (or [cuda13])",
    ),
]

BUCKET = 4 << 20
WEIGHTS = "ckpt_core.testing.weights:"
CALL_TIMEOUT_S = 120.0
P0, R0, R1 = range(3)


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalProcessPool]:
    """Policy rank 0 and rollout ranks 0, 1, all on cuda:0, each its own process."""
    specs, labels = refit_worker_specs(
        backend="cuda_ipc",
        num_policy=1,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={"device": "cuda:0", "timeout_s": 60},
        weights=WEIGHTS + "every_dtype",
    )
    for spec in specs:
        spec["service"] = "cuda_ipc_helpers:CudaProbeWorker"
    with LocalProcessPool(specs, labels=labels, env=env_with_helpers()) as workers:
        yield workers


def memory(pool: LocalProcessPool, index: int) -> dict[str, Any]:
    (result,) = pool.call([(index, "cuda_memory", {})], CALL_TIMEOUT_S)
    assert result.ok, result.describe()
    return result.value


def test_one_to_one_bit_exact_from_host_and_device_sources(pool: LocalProcessPool) -> None:
    refits = coordinator_for(pool, [P0], [R0], CALL_TIMEOUT_S)
    refits.setup()
    digests = []
    for _ in range(3):
        report = refits.refit()  # every tensor checked bit-exact against the source
        assert report.rollout[0]["tensors"] == len(report.policy[0]["digests"]) >= 40
        digests.append(report.rollout[0]["digests"])
    assert digests[0] != digests[1] != digests[2]
    report = refits.refit(weights="cuda_ipc_helpers:every_dtype_on_gpu", weights_params={"elements": 100_003})
    assert report.rollout[0]["stats"]["buckets"] > 1
    report = refits.refit(weights=WEIGHTS + "sized", weights_params={"sizes": [3 * BUCKET + 8, BUCKET, 0, 5]})
    assert report.rollout[0]["stats"]["buckets"] >= 5
    refits.finalize()


def test_one_policy_feeds_two_rollouts_on_the_same_gpu(pool: LocalProcessPool) -> None:
    refits = coordinator_for(pool, [P0], [R0, R1], CALL_TIMEOUT_S)
    refits.setup()
    for _ in range(2):
        report = refits.refit(weights=WEIGHTS + "sized", weights_params={"sizes": [2 * BUCKET + 4, 4096, 1]})
        assert [r["tensors"] for r in report.rollout] == [3, 3]
    refits.finalize()


def test_twenty_refits_do_not_grow_device_memory(pool: LocalProcessPool) -> None:
    refits = coordinator_for(pool, [P0], [R0], CALL_TIMEOUT_S)
    weights = {"sizes": [3 * BUCKET + 8, BUCKET // 2, 12345]}
    refits.setup()
    for _ in range(2):  # the caching allocators settle on the first refits
        refits.refit(weights=WEIGHTS + "sized", weights_params=weights)
    first = {i: memory(pool, i) for i in (P0, R0)}
    for _ in range(18):
        refits.refit(weights=WEIGHTS + "sized", weights_params=weights)
    last = {i: memory(pool, i) for i in (P0, R0)}
    # A buffer, mapping or cached block leaked per refit would show 18 times over here.
    slack = BUCKET
    assert last[P0]["device_free"] >= first[P0]["device_free"] - slack, (first, last)
    for i in (P0, R0):
        assert last[i]["reserved"] <= first[i]["reserved"], (i, first[i], last[i])
    refits.finalize()
    # finalize() gives the two slots (one allocation, 2 x bucket) back to the device.
    freed = memory(pool, P0)["device_free"] - last[P0]["device_free"]
    assert freed >= 2 * BUCKET - (1 << 20), freed
