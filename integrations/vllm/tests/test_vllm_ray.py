"""vLLM's Ray client driving the ckpt backend: an ``LLM`` in a Ray actor (vLLM's own offline
engine, weight transfer selected by ``weight_transfer_config={"backend": "ckpt"}``), refitted by
a ``CkptTrainerWeightTransferEngine`` in this process through ``RayVLLMWeightSyncClient``.

Its greedy tokens after each refit of W1..W3 must equal what the same actor generated from W_k
as vLLM loaded it (W1 at start-up, W2 and W3 by vLLM's own reload; the actor is left at W3, so
the first refit changes every weight), and the version the trainer gave is the one the engine
reports. A local Ray cluster of its own; the actor asks for no CPU, as in tests/orchestration/test_ray.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PROMPTS, engine_args

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

BUCKET = 1 << 20
CALL_TIMEOUT_S = 120.0
START_TIMEOUT_S = 240.0


def weights_on_disk(path: Path) -> list[tuple[str, Any]]:
    """W as the trainer saved it (bf16 safetensors): what a trainer holding W would send."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    assert files, f"no safetensors in {path}"
    return [pair for file in files for pair in load_file(str(file)).items()]


def actor_tokens(actor: Any) -> list[list[int]]:
    from vllm import SamplingParams

    assert ray.get(actor.reset_prefix_cache.remote(), timeout=CALL_TIMEOUT_S)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = ray.get(actor.generate.remote(prompts, params, use_tqdm=False), timeout=CALL_TIMEOUT_S)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def llm_actor(checkpoints: dict[str, Any]) -> Iterator[tuple[Any, list[list[list[int]]]]]:
    """An ``LLM`` actor started from W1, and the tokens each refit must reproduce."""
    from vllm import LLM

    first, *later = checkpoints["weights"]
    # The engine runs inside the actor's process (no engine-core or worker process of its
    # own, as Ray-based RL frameworks often run it): two fewer start-ups of vLLM, which under
    # CI's load took minutes.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        actor = ray.remote(num_cpus=0)(LLM).remote(
            **engine_args(first, 1), weight_transfer_config={"backend": "ckpt"}, distributed_executor_backend="uni"
        )
        ray.get(actor.__ray_ready__.remote(), timeout=START_TIMEOUT_S)
        references = [actor_tokens(actor)]
        for path in later:
            kwargs = {"weights_path": str(path), "is_checkpoint_format": True}
            ray.get(actor.collective_rpc.remote("reload_weights", kwargs=kwargs), timeout=CALL_TIMEOUT_S)
            references.append(actor_tokens(actor))
        assert len({str(tokens) for tokens in references}) == len(references), "a step did not change the tokens"
        yield actor, references
    finally:
        ray.shutdown()


@pytest.mark.parametrize("backend", ["gloo_cpu", "cuda_ipc"])
def test_refits_through_vllms_ray_client(
    backend: str, llm_actor: tuple[Any, list[list[list[int]]]], checkpoints: dict[str, Any]
) -> None:
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient, WeightTransferTrainerFactory

    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo

    actor, references = llm_actor
    kwargs = {"device": "cpu"} if backend == "cuda_ipc" else {}
    info = CkptTrainerInitInfo(rank=0, transport=backend, bucket_size_bytes=BUCKET, engine_kwargs=kwargs)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=RayVLLMWeightSyncClient(actor))
    try:
        for k, (path, expected) in enumerate(zip(checkpoints["weights"], references, strict=True), start=1):
            version = f"{backend}-w{k}"
            engine.send_weights(weights_on_disk(path), weight_version=version)
            assert actor_tokens(actor) == expected, f"{backend}: after the refit of W{k} the tokens differ"
            assert ray.get(actor.get_weight_version.remote(), timeout=CALL_TIMEOUT_S) == version
    finally:
        engine.shutdown()
        ray.get(actor.shutdown_weight_transfer_engine.remote(), timeout=CALL_TIMEOUT_S)


def test_verls_manager_lands_its_syncs_in_this_engine(
    llm_actor: tuple[Any, list[list[list[int]]]], checkpoints: dict[str, Any]
) -> None:
    """verl's ``CheckpointEngineManager`` syncs W1 then W2 from a trainer actor (ckpt-verl's
    ``ckpt_gloo_cpu`` engine) to a replica's ``CheckpointEngineWorker``, whose server adapter,
    ckpt-verl's ``CkptVllmServerAdapter``, refits this engine through vLLM's Ray client (the
    ckpt backend over cuda_ipc on the host): after each sync the engine generates what it did
    from that W as vLLM loaded it, under verl's ``global_steps`` as its weight version."""
    pytest.importorskip("verl", reason="verl is not installed (the dev set-up pins verl==0.9.1)")
    from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineWorker
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    from ckpt_verl.testing import StandInReplica, WeightsTrainer
    from ckpt_verl.vllm_adapter import CkptVllmServerAdapter

    actor, references = llm_actor  # left at W3 by the test before
    config = CheckpointEngineConfig(
        backend="ckpt_gloo_cpu", update_weights_bucket_megabytes=1, engine_kwargs={"ckpt_gloo_cpu": {"timeout_s": 120}}
    )
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config, tensor_model_parallel_size=1)
    adapter = CkptVllmServerAdapter(
        rollout_config, client=RayVLLMWeightSyncClient(actor), transport="cuda_ipc", engine_kwargs={"device": "cpu"}
    )

    def group(cls: type, **init: Any) -> RayWorkerGroup:
        pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
        return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(cls), **init))

    saved = [str(path) for path in checkpoints["weights"]]
    trainers = group(WeightsTrainer, config=config, checkpoints=saved)
    rollout = group(CheckpointEngineWorker, rollout_config=rollout_config, model_config=None, server_adapter=adapter)
    manager = CheckpointEngineManager(config, trainers, [StandInReplica(rollout.workers)])
    try:
        for global_steps in (1, 2):
            manager.update_weights(global_steps=global_steps)
            assert actor_tokens(actor) == references[global_steps - 1], f"after verl's sync of W{global_steps}"
            assert ray.get(actor.get_weight_version.remote(), timeout=CALL_TIMEOUT_S) == str(global_steps)
    finally:
        for worker in trainers.workers + rollout.workers:
            ray.kill(worker)
        ray.get(actor.shutdown_weight_transfer_engine.remote(), timeout=CALL_TIMEOUT_S)
