"""Quantize-on-send into an FP8 vLLM (the CPU build): a compressed-tensors FP8 checkpoint with
per-channel scales served by vLLM, refitted by a BF16 trainer whose engine quantizes each
weight the workers' ``weight_quantization`` names (``quantize_for_rollout``), the workers
having derived it from their live model.

Three refits in a row, each token-equal to vLLM quantizing the same trainer weights itself:
its online ``fp8_per_channel`` of W1 at start-up, then its own reload of W2 and W3. The
refitted engine starts from an FP8 checkpoint of the start-up model, so the first refit
changes every weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REFITS, greedy_tokens, reload_from_disk, trainer_pool, vllm_engine
from test_vllm_refit import CALL_TIMEOUT_S, in_parallel, train

from ckpt_core.fp8 import Fp8Format, quantize
from ckpt_core.orchestration.rendezvous import MetadataRendezvous

BUCKET = 1 << 20
BACKENDS: dict[str, dict[str, Any]] = {"gloo_cpu": {}, "cuda_ipc": {"device": "cpu"}}
# compressed-tensors' FP8 with per-channel weight scales and dynamic per-token activations
# (llm-compressor's FP8_DYNAMIC), the head left in bf16.
COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_fp8_checkpoint(source: Path, target: Path) -> Path:
    """``source`` (a bf16 checkpoint) as a compressed-tensors FP8 checkpoint: every linear
    layer's weight per-channel FP8 with its ``weight_scale``, the rest as it was."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.endswith(".weight") and name.split(".")[-2] in LINEAR:
                quantized = quantize(name, tensor, Fp8Format.PER_CHANNEL)
                tensors[name], tensors[quantized.scale_name] = quantized.weight, quantized.scale
            else:
                tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": COMPRESSED_TENSORS_FP8}))
    return target


@pytest.fixture(scope="module")
def fp8_references(checkpoints: dict[str, Any]) -> list[list[list[int]]]:
    """What vLLM generates from W1..W3 quantizing them itself (online ``fp8_per_channel``)."""
    first, *later = checkpoints["weights"]
    with vllm_engine(first, 1, quantization="fp8_per_channel") as llm:
        references = [greedy_tokens(llm.generate)]
        for path in later:
            reload_from_disk(llm, path)
            references.append(greedy_tokens(llm.generate))
    assert len({str(tokens) for tokens in references}) == len(references), "a step did not change the tokens"
    return references


@pytest.fixture(scope="module")
def fp8_llm(checkpoints: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An engine served from an FP8 checkpoint of the start-up model."""
    start = save_fp8_checkpoint(checkpoints["start"], tmp_path_factory.mktemp("fp8") / "start")
    with vllm_engine(start, 1, weight_transfer_config={"backend": "ckpt"}) as llm:
        yield llm


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_three_quantizing_refits_equal_vllms_own_fp8(
    backend: str, fp8_llm: Any, fp8_references: list[list[list[int]]], checkpoints: dict[str, Any]
) -> None:
    engine_kwargs = {**BACKENDS[backend], "quantize_for_rollout": True}
    init_info = {"transport": backend, "bucket_size_bytes": BUCKET, "engine_kwargs": engine_kwargs}
    try:
        with trainer_pool(checkpoints["start"], backend, **engine_kwargs) as trainer:
            with MetadataRendezvous() as rendezvous:
                (joined,), _ = in_parallel(
                    lambda: trainer.call(
                        [(0, "connect", {"rendezvous": rendezvous.address, "rollout_world_size": 1})], CALL_TIMEOUT_S
                    ),
                    lambda: fp8_llm.init_weight_transfer_engine(
                        {"init_info": {**init_info, "rendezvous": rendezvous.address}}
                    ),
                )
                assert joined.ok, joined.describe()
            for k in range(REFITS):
                train(trainer)
                fp8_llm.start_weight_update()
                (sent,), _ = in_parallel(
                    lambda: trainer.call([(0, "refit", {})], CALL_TIMEOUT_S),
                    lambda: fp8_llm.update_weights({"update_info": {}}),
                )
                assert sent.ok, sent.describe()
                fp8_llm.finish_weight_update(weight_version=f"fp8-{k + 1}")
                assert fp8_llm.reset_prefix_cache()
                assert greedy_tokens(fp8_llm.generate) == fp8_references[k], f"{backend}: tokens differ after {k + 1}"
    finally:
        fp8_llm.shutdown_weight_transfer_engine()
