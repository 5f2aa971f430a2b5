"""Delta refits between real processes (issue 34, point 1): gloo_cpu and cuda_ipc on the CPU,
paired, broadcast and fanned out with destination layouts, through a coordinator that checks every
received weight's digest against what its sender's weights hold. Small changes must travel as
patches, and a rollout whose process is killed and started again between refits must get whole
weights, then patches again, while its neighbour keeps patching (unless they share one
broadcast stream: then both get whole weights); and a refit that fails midway must leave every
baseline as it was, so that the same step travels as patches after it."""

from __future__ import annotations

import pytest

from ckpt_core.orchestration.coordinator import RefitCoordinator, RefitFailedError, RefitReport
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.refit.layout import WeightLayout, slices, whole
from ckpt_core.testing.weights import drifting

BUCKET = 1 << 16
FRACTIONS = [0.0, 0.0001, 0.01, 0.1, 1.0, 0.01]  # of refits 1, 2, ... in turn
PARAMS = {"seed": 5, "elements": 4096, "fractions": FRACTIONS}
WEIGHTS = "ckpt_core.testing.weights:drifting"
FAILING = "tests.helpers.failing_weights:drifting_then_failing"


def half_layout(rank: int) -> WeightLayout:
    """Rank ``rank`` of 2 keeps its half of every 1-D weight of two or more elements, the rest
    whole: the patches of each rank are of its own parts."""
    kept = {}
    for name, tensor in drifting(PARAMS, refit_index=0, rank=0):
        shape = tuple(tensor.shape)
        if len(shape) == 1 and shape[0] >= 2:
            half = shape[0] // 2
            kept[name] = slices(shape, 0, [(0, half)] if rank == 0 else [(half, shape[0] - half)])
        else:
            kept[name] = whole(shape)
    return WeightLayout(kept)


def received_bytes(report: RefitReport) -> list[int]:
    return [result["stats"]["payload_bytes"] for result in report.rollout]


def refit(coordinator: RefitCoordinator, version: int) -> list[int]:
    """Refit weights version ``version`` (checked digest by digest); each rollout rank's bytes."""
    return received_bytes(coordinator.refit(weights=WEIGHTS, weights_params={**PARAMS, "version": version}))


CASES = {
    "gloo_cpu-paired": ("gloo_cpu", {"topology": "paired"}, 2, False),
    "gloo_cpu-fanout-layouts": ("gloo_cpu", {"topology": "fanout"}, 1, True),
    "cuda_ipc_cpu-fanout-layouts": ("cuda_ipc", {"topology": "fanout", "device": "cpu"}, 1, True),
    "gloo_cpu-broadcast": ("gloo_cpu", {"topology": "broadcast"}, 1, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_delta_refits_between_processes_patch_small_changes_and_survive_a_restarted_rollout(case: str) -> None:
    backend, options, num_policy, sharded = CASES[case]
    layouts = [half_layout(rank).to_json() for rank in range(2)] if sharded else None
    specs, labels = refit_worker_specs(
        backend=backend,
        num_policy=num_policy,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={**options, "delta": True, "shard_expert_weights": sharded},
        weights=WEIGHTS,
        weights_params=PARAMS,
        weight_layouts=layouts,
    )
    with LocalProcessPool(specs, labels=labels) as pool:
        coordinator = RefitCoordinator(
            pool, num_policy=num_policy, num_rollout=2, timeout_s=60, topology=options["topology"]
        )
        coordinator.setup()
        first = refit(coordinator, 0)  # nothing held yet: every weight whole
        for version in range(1, 7):
            moved = refit(coordinator, version)
            fraction = FRACTIONS[(version - 1) % len(FRACTIONS)]
            for rank in range(2):
                if version == 6:  # untracked at version 5: whole (and tracked) again
                    assert moved[rank] >= first[rank], (version, rank, moved, first)
                elif fraction <= 0.01:
                    assert moved[rank] < 0.25 * first[rank], (version, rank, moved, first)
                elif fraction == 1.0:  # no patch is smaller: every weight whole again
                    assert moved[rank] >= first[rank], (version, rank, moved, first)
        coordinator.finalize()

        # Rollout rank 1's process is killed and started again (it holds nothing); rank 0
        # keeps its baseline.
        pool.kill(num_policy + 1)
        pool.restart(num_policy + 1)
        coordinator.setup()
        moved = refit(coordinator, 7)  # a step that changed nothing
        assert moved[1] >= first[1], moved
        if options["topology"] == "broadcast":  # one stream to both ranks: whole to both
            assert moved[0] >= first[0], moved
        else:
            assert moved[0] < 0.25 * first[0], moved
        moved = refit(coordinator, 8)
        assert all(moved[rank] < 0.25 * first[rank] for rank in range(2)), (moved, first)

        # A refit that fails midway (the sender's weights raise near their end, after buckets of
        # patches were applied): every side puts back or keeps its baseline, so that after a
        # new init other weights (version 9, not the failed 10: patches set values, so a retry of
        # the same weights would hide a baseline left half patched) arrive bit for bit as patches.
        failing = {**PARAMS, "version": 10, "fail_after": 45}  # of 49 weights
        with pytest.raises(RefitFailedError):
            coordinator.refit(weights=FAILING, weights_params=failing)
        coordinator.finalize()
        coordinator.setup()
        moved = refit(coordinator, 9)  # 1% changed since version 8
        assert all(moved[rank] < 0.25 * first[rank] for rank in range(2)), (moved, first)
        coordinator.finalize()


def test_half_layouts_cover_every_weight_once() -> None:
    """The test's own layouts: the two ranks together keep every element exactly once, where
    a weight is split (a layout that dropped parts would let a delta bug hide)."""
    total = sum(tensor.numel() for _, tensor in drifting(PARAMS, refit_index=0, rank=0))
    split = [half_layout(rank) for rank in range(2)]
    unsplit = sum(
        tensor.numel()
        for _, tensor in drifting(PARAMS, refit_index=0, rank=0)
        if not (tensor.dim() == 1 and tensor.numel() >= 2)
    )
    assert sum(layout.received_elements() for layout in split) == total + unsplit
