"""A bucket of small whole tensors received owned over Gloo is not copied out of its slot:
the transport hands the slot's memory over and takes new memory for the slot
(``BucketReceiver.hand_over``), rotating among blocks of its own and taking one no tensor holds.
Real processes, real Gloo groups: the tensors of every refit must stay as they arrived through
the refits after it, each on a storage of at most 1 MiB; a transport whose buffer is shared
with its sender (cuda_ipc) copies them out as before."""

from __future__ import annotations

import pytest

from ckpt_core._internal.assembly import SHARED_STORAGE_BYTES
from ckpt_core._internal.slot_memory import SlotMemories
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs

CASES = {  # case -> (backend, options, whether the receivers hand their slots over)
    "gloo_cpu-paired": ("gloo_cpu", {"topology": "paired"}, True),  # framed: frame and payload as one message
    "gloo_cpu-broadcast": ("gloo_cpu", {"topology": "broadcast"}, True),  # the payload after its header
    "cuda_ipc_cpu": ("cuda_ipc", {"device": "cpu"}, False),
}
BUCKET = 256 << 10  # several buckets per refit, so both slots are handed over and reused
PARAMS = {"seed": 3, "count": 150}


ROLLOUTS = {  # rollout -> (its worker service, None for the default; how many refits it keeps, None: all)
    "rollout-keeps-every-refit": ("tests.helpers.keeping_worker:KeepingWorker", None),
    "rollout-keeps-its-last-two-refits-pool-off": ("tests.helpers.keeping_worker:KeepingLastTwoWorker", 2),
    "rollout-drops-each-refit": (None, 0),
    "rollout-drops-and-releases-its-pool": ("tests.helpers.keeping_worker:ReleasingWorker", 0),
}


def _handed_over(refit: int, buckets: int, keep: int | None) -> int:
    """How many of refit ``refit``'s ``buckets`` a rank hands over, refits before it alike
    (:class:`SlotMemories`' rule, followed slot by slot; bucket k uses slot k % 2). The rank
    holds every tensor of a refit until it ends, then keeps the last ``keep`` refits (``None``:
    all). A slot hands over while a block it gave away is free, or while it has fewer than
    ``ROTATION`` blocks; the memory it was made with is not one of them."""
    handed = 0
    for count in ((buckets + 1) // 2, buckets // 2):
        given: list[int] = []  # the slot's handed-over blocks: the refit whose tensors are on each
        rotating = False  # whether the slot receives into a block of its rotation yet
        for index in range(refit + 1):
            for _ in range(count):
                free = [r for r in given if keep is not None and r < index - keep]
                if free:
                    given.remove(free[0])
                elif len(given) >= SlotMemories.ROTATION - 1:
                    continue  # refused: the bucket is copied out
                if rotating:
                    given.insert(0, index)
                rotating = True
                handed += index == refit
    return handed


@pytest.mark.parametrize("rollout", list(ROLLOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_tensors_of_handed_over_buckets_stay_as_they_arrived_through_later_refits(case: str, rollout: str) -> None:
    """Each slot hands over while one of the blocks it rotates among is free (:func:`_handed_over`
    counts them), whether that block waits in the pool or the rollout handed the pool back; a
    rollout that keeps every refit gets later buckets copied out, its memory never reused under
    it."""
    backend, options, hands_over = CASES[case]
    service, keep = ROLLOUTS[rollout]
    specs, labels = refit_worker_specs(
        backend=backend,
        num_policy=2 if options.get("topology") == "paired" else 1,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs=options,
        weights="tests.helpers.keeping_worker:small_weights",
        weights_params=PARAMS,
    )
    if service is not None:
        for spec in specs:
            spec["service"] = service
    num_policy = len(specs) - 2
    with LocalProcessPool(specs, labels=labels) as pool:
        coordinator = RefitCoordinator(
            pool, num_policy=num_policy, num_rollout=2, timeout_s=60, topology=options.get("topology", "broadcast")
        )
        coordinator.setup()
        try:
            arrived = []  # per refit, each rollout rank's digests on arrival (checked against the sender's)
            for refit in range(4):
                report = coordinator.refit()  # checked digest by digest against the sender's
                arrived.append([result["digests"] for result in report.rollout])
                buckets = [result["stats"]["buckets"] for result in report.rollout]
                handed = [result["stats"]["handed_over_buckets"] for result in report.rollout]
                assert min(buckets) >= 5, buckets
                expected = [_handed_over(refit, count, keep) for count in buckets]
                assert handed == (expected if hands_over else [0, 0]), (refit, handed, buckets)
            assert len({digest for refit in arrived for digest in refit[0].values()}) > 150  # refits differ
            if keep == 0:
                return
            rollouts = range(num_policy, num_policy + 2)
            later = pool.call([(index, "kept_digests", {}) for index in rollouts], timeout_s=60)
            assert all(result.ok for result in later), later
            for rank, result in enumerate(later):
                want = [refit[rank] for refit in arrived][-(keep or len(arrived)) :]
                assert result.value == want, f"rollout rank {rank}'s kept tensors changed"
            largest = pool.call([(index, "largest_kept_storage", {}) for index in rollouts], timeout_s=60)
            assert all(result.ok and result.value <= SHARED_STORAGE_BYTES for result in largest), largest
        finally:
            coordinator.finalize()
