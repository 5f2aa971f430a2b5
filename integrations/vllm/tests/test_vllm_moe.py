"""Sharded refits of a mixture-of-experts model into vLLM at tensor-parallel size 2.

One trainer process (``RefitWorker``, gloo_cpu ``fanout``) sends each vLLM rank only what its
live model keeps: its half of every attention and dense matrix and its tensor-parallel share of
every expert. Three refits in a row through a ``RefitCoordinator`` checking every received
shard's digest against what the trainer's stream carried; after each, greedy tokens equal
those of the same engine after vLLM's own ``reload_weights`` from the same weights on disk.

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
from conftest import HERE, REFITS, greedy_tokens, vllm_engine
from moe_weights import save_tiny_qwen2_moe, save_version

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
    from ckpt_vllm import WORKER_EXTENSION

    with vllm_engine(moe_checkpoints["start"], TP, worker_extension_cls=WORKER_EXTENSION) as llm:
        yield llm


def trainer(start: Path) -> LocalProcessPool:
    spec = {
        "service": "ckpt_core.orchestration.worker:RefitWorker",
        "role": "policy",
        "rank": 0,
        "backend": "gloo_cpu",
        "bucket_size": 1 << 20,
        "engine_kwargs": OPTIONS,
        "weights": "moe_weights:perturbed",
        "weights_params": {"model": str(start), "version": 1},
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return LocalProcessPool([spec], labels=["trainer"], env=env)


def reloaded_tokens(llm: Any, path: Path) -> list[list[int]]:
    """What ``llm`` generates after vLLM's own reload of the weights at ``path``."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
    assert llm.reset_prefix_cache()
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
            assert seen[0] != seen[1] != seen[2], "the versions do not change the tokens"
        finally:
            coordinator.finalize()
