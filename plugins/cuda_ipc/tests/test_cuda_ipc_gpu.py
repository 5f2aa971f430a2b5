"""cuda_ipc with ``device="cuda"``: policy and rollouts as separate processes on one GPU, and
the slots' memory in this process.

Run by ``scripts/gpu_check.sh`` (``pytest -m gpu``). Skipped without a CUDA device, and
without cupy (``pip install 'ckpt-cuda-ipc[cuda12]'`` or ``[cuda13]``), which this mode needs.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cuda_ipc_helpers import coordinator_for, env_with_helpers

from ckpt_core.errors import EngineOptionError
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_cuda_ipc.buffers import CudaSlots, import_cupy

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
    """Policy rank 0 and rollout ranks 0, 1, all on cuda:0, each its own process, with the
    device checksum on (computed by the policy, verified by each rollout, on the GPU); rollout
    rank 1 borrows its received tensors (views of the slots)."""
    specs, labels = refit_worker_specs(
        backend="cuda_ipc",
        num_policy=1,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={"device": "cuda:0", "timeout_s": 60, "checksum": True},
        weights=WEIGHTS + "every_dtype",
    )
    for spec in specs:
        spec["service"] = "cuda_ipc_helpers:CudaProbeWorker"
    specs[R1]["engine_kwargs"] = {**specs[R1]["engine_kwargs"], "borrow_received_tensors": True}
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


def test_the_slot_tensors_are_the_allocation_and_outlive_close_while_viewed() -> None:
    """The views alias the raw cudaMalloc (a write at its address shows in them: no copy), and
    close() under a live view leaves the memory allocated until that view dies."""
    device = torch.device("cuda", 0)
    slots = CudaSlots.allocate(device, BUCKET, 2)
    kept = slots.view(1)
    import_cupy().cuda.runtime.memset(slots.pointer + slots.stride, 7, BUCKET)
    torch.cuda.synchronize(device)
    assert bool((kept == 7).all()), "the slot view is not the allocation"
    kept.fill_(9)
    slots.close()
    assert slots.mapped, "close() freed the memory under a live view"
    assert int(kept.sum(dtype=torch.int64)) == 9 * BUCKET
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    del kept
    assert not slots.mapped
    freed = torch.cuda.mem_get_info(device)[0] - free_before
    assert freed >= 2 * slots.stride - (2 << 20), f"dropping the last view freed only {freed} bytes"


def test_a_rollout_on_another_gpu_is_refused_by_uuid_before_the_handle_is_opened() -> None:
    device = torch.device("cuda", 0)
    mine = str(torch.cuda.get_device_properties(device).uuid)
    slots = CudaSlots.allocate(device, BUCKET, 2)
    try:
        description = slots.describe()
    finally:
        slots.close()
    assert description["gpu_uuid"] == mine
    description["gpu_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(EngineOptionError, match=re.escape(f"is GPU {mine}, but policy rank 0's buffers are on GPU")):
        CudaSlots.attach(description, device, BUCKET, 2)


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


def test_a_borrowed_tensor_kept_past_finalize_stays_readable(pool: LocalProcessPool) -> None:
    """A rollout that finalizes while a borrowed tensor is alive keeps its IPC mapping until
    the tensor dies: reading it stays legal (unmapped, it would be an illegal address that
    poisons the process's CUDA context), and the mapping closes when the tensor goes. Last in
    this module: on failure rollout rank 1's CUDA context may be unusable."""
    refits = coordinator_for(pool, [P0], [R1], CALL_TIMEOUT_S)
    refits.setup()
    try:
        sent, received = pool.call(
            [
                (
                    P0,
                    "refit",
                    {
                        "refit_index": 0,
                        "weights": WEIGHTS + "sized",
                        "weights_params": {"sizes": [BUCKET // 2, 4096, 40]},
                    },
                ),
                (R1, "receive_keeping_a_borrowed_tensor", {}),
            ],
            CALL_TIMEOUT_S,
        )
        assert sent.ok and received.ok, (sent.describe(), received.describe())
        assert received.value["tensors"] == 3
        (result,) = pool.call([(R1, "finalize_then_read_the_kept_tensor", {})], CALL_TIMEOUT_S)
        assert result.ok, result.describe()
        report = result.value
        assert report["mapped_after_finalize"] and report["sum_after"] == report["sum_before"], report
        assert not report["mapped_after_drop"] and report["healthy"], report
    finally:
        refits.finalize()
