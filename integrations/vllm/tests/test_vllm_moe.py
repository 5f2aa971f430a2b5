"""Sharded refits of a mixture-of-experts model into vLLM at tensor-parallel size 2.

One trainer process (``RefitWorker``, gloo_cpu ``fanout``) sends each vLLM rank only what its
live model keeps: its half of every attention and dense matrix and its tensor-parallel share of
every expert. Two refits in a row through a ``RefitCoordinator`` checking every received
shard's digest against what the trainer's stream carried; after each, greedy tokens equal
those of the same engine after vLLM's own ``reload_weights`` from the same weights on disk.
Then a trainer yielding its experts fused, as transformers 5 holds them in memory, through
the same sharded refit (each rank's layout names both namings).

Not against a fresh engine: on vLLM's CPU build (0.32) an in-place reload of this MoE model,
vLLM's own from disk included, generates other tokens than a fresh engine loaded from the same
files (checked here: the refit and vLLM's reload agree with each other, not with the fresh
engine), so the fresh engine is not the reference a reload can reach.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HERE, REFITS, greedy_tokens, reload_from_disk, vllm_engine
from moe_weights import save_fused_version, save_tiny_qwen2_moe, save_version

from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.joined import JoinedPool
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_vllm import VllmRollout, VllmWorkerPool

TP = 2
OPTIONS = {"shard_expert_weights": True, "topology": "fanout", "timeout_s": 60.0}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tiny_qwen2_moe")
    start = save_tiny_qwen2_moe(root / "start")
    return {"start": start, "weights": [save_version(start, root / f"w{k}", k) for k in range(1, REFITS + 1)]}


@pytest.fixture(scope="module")
def moe_llm(moe_checkpoints: dict[str, Any]) -> Iterator[Any]:
    from ckpt_vllm import VLLM_ENGINE_ARGS

    with vllm_engine(moe_checkpoints["start"], TP, **VLLM_ENGINE_ARGS) as llm:
        yield llm


def trainer(start: Path, weights: str = "moe_weights:perturbed", version: int = 1) -> LocalProcessPool:
    spec = {
        "service": "ckpt_core.orchestration.worker:RefitWorker",
        "role": "policy",
        "rank": 0,
        "backend": "gloo_cpu",
        "bucket_size": 1 << 20,
        "engine_kwargs": OPTIONS,
        "weights": weights,
        "weights_params": {"model": str(start), "version": version},
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return LocalProcessPool(
        [spec], labels=["trainer"], env=env, preload=["transformers.models.qwen2_moe.modeling_qwen2_moe"]
    )


def reloaded_tokens(llm: Any, path: Path) -> list[list[int]]:
    """What ``llm`` generates after vLLM's own reload of the weights at ``path``."""
    reload_from_disk(llm, path)
    return greedy_tokens(llm.generate)


def test_sharded_moe_refits_match_vllms_own_reload_and_move_each_rank_its_share(
    moe_llm: Any, moe_checkpoints: dict[str, Any]
) -> None:
    rollout = VllmRollout(moe_llm, backend="gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs=OPTIONS, verify=True)
    with trainer(moe_checkpoints["start"]) as policy:
        coordinator = RefitCoordinator(
            JoinedPool(policy, VllmWorkerPool(rollout)), num_policy=1, num_rollout=TP, timeout_s=120, topology="fanout"
        )
        coordinator.setup()
        try:
            seen = []
            for k in range(REFITS):
                report = coordinator.refit()  # every shard's digest checked against its stream's
                refitted = greedy_tokens(rollout.generate)
                seen.append(refitted)
                assert refitted == reloaded_tokens(moe_llm, moe_checkpoints["weights"][k]), f"refit {k + 1}"
                held = [s["parameter_bytes"] for s in rollout.status()]
                received = [r["stats"]["payload_bytes"] for r in report.rollout]
                for rank, (got, own) in enumerate(zip(received, held)):
                    assert abs(got - own) <= 0.01 * own, f"rank {rank} received {got} bytes, holds {own}"
                model_bytes = (moe_checkpoints["start"] / "model.safetensors").stat().st_size
                assert max(received) < 0.7 * model_bytes
            assert seen[0] != seen[1], "the versions do not change the tokens"
        finally:
            coordinator.finalize()


def test_a_trainer_holding_its_experts_fused_refits_the_sharded_engine(
    moe_llm: Any, moe_checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    """A trainer on transformers 5 yields ``experts.gate_up_proj`` ``[E, 2 * I, H]`` and
    ``experts.down_proj`` ``[E, H, I]`` per layer, not one tensor per expert: each rank
    receives its rows of the gate half and of the up half, and its columns of down (every
    shard's digest, and their count, checked by the coordinator against what its stream
    carried), and generates what vLLM's own reload of the same weights, saved one tensor per
    expert, does."""
    start, version = moe_checkpoints["start"], 7
    rollout = VllmRollout(moe_llm, backend="gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs=OPTIONS, verify=True)
    with trainer(start, "moe_weights:fused", version) as policy:
        coordinator = RefitCoordinator(
            JoinedPool(policy, VllmWorkerPool(rollout)), num_policy=1, num_rollout=TP, timeout_s=120, topology="fanout"
        )
        coordinator.setup()
        try:
            before = greedy_tokens(rollout.generate)
            report = coordinator.refit()
            for rank, carried in report.policy[0]["by_destination"].items():
                names = sorted(carried["digests"])
                fused = [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
                assert len(fused) == 4 and not any(".experts.0." in n for n in names), f"rank {rank}: {names}"
            held = [s["parameter_bytes"] for s in rollout.status()]
            for rank, (received, own) in enumerate(zip(report.rollout, held)):
                got = received["stats"]["payload_bytes"]
                assert abs(got - own) <= 0.01 * own, f"rank {rank} received {got} bytes, holds {own}"
            refitted = greedy_tokens(rollout.generate)
            assert refitted != before, "the refit did not change the tokens"
            assert refitted == reloaded_tokens(moe_llm, save_fused_version(start, tmp_path / "fused", version))
        finally:
            coordinator.finalize()
