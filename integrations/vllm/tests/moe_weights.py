"""A tiny Qwen2-MoE for the sharded-refit test, and the weights a trainer would send.

``save_tiny_qwen2_moe`` writes a random model (4 experts, 2 per token, a shared expert) with
``save_pretrained``; :func:`perturbed` is a ``RefitWorker`` weights factory yielding its
checkpoint tensors (per-expert names, as vLLM loads them) plus a deterministic change that
grows with the refit index, so that every refit moves the model somewhere new.
:func:`fused` yields what a trainer on transformers 5 holds instead: its model's state dict,
whose experts are fused (``experts.gate_up_proj`` ``[E, 2 * I, H]``, ``experts.down_proj``
``[E, H, I]``), changed the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

TINY_QWEN2_MOE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "num_attention_heads": 4,  # head_dim 64: vLLM's CPU attention refuses 16
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def save_tiny_qwen2_moe(path: Path, *, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**TINY_QWEN2_MOE)).bfloat16()
    model.save_pretrained(str(path))
    return path


def perturbed(params: dict[str, Any], *, refit_index: int, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The start-up checkpoint of ``params["model"]`` changed for version ``params["version"]
    + refit_index`` (bf16, in the checkpoint's order)."""
    from safetensors import safe_open

    version = int(params.get("version", 0)) + refit_index
    generator = torch.Generator().manual_seed(1000 + version)
    with safe_open(str(Path(params["model"]) / "model.safetensors"), framework="pt") as source:
        for name in source.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            tensor = source.get_tensor(name).float()
            noise = torch.randn(tensor.shape, generator=generator) * 0.02 * (1 + version)
            yield name, (tensor + noise).to(torch.bfloat16)


def save_version(start: Path, target: Path, version: int) -> Path:
    """W for ``version`` saved where a fresh vLLM engine can load it."""
    from safetensors.torch import save_file

    target.mkdir(parents=True)
    save_file(
        dict(perturbed({"model": str(start), "version": version}, refit_index=0)), str(target / "model.safetensors")
    )
    for extra in ("config.json", "generation_config.json"):
        if (start / extra).exists():
            (target / extra).write_bytes((start / extra).read_bytes())
    return target


@functools.lru_cache(maxsize=1)
def _in_memory_state(model: str) -> dict[str, torch.Tensor]:
    """The state dict transformers 5 builds from the checkpoint at ``model`` (experts fused)."""
    import transformers

    loaded = transformers.Qwen2MoeForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    return {name: tensor.detach().clone() for name, tensor in loaded.state_dict().items()}


def fused(params: dict[str, Any], *, refit_index: int, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The in-memory state dict of ``params["model"]`` (fused experts, in the model's order)
    changed for version ``params["version"] + refit_index`` (bf16)."""
    version = int(params.get("version", 0)) + refit_index
    generator = torch.Generator().manual_seed(2000 + version)
    for name, tensor in _in_memory_state(str(params["model"])).items():
        noise = torch.randn(tensor.shape, generator=generator) * 0.02 * (1 + version)
        yield name, (tensor.float() + noise).to(torch.bfloat16)


def unfused(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with fused experts written one tensor per expert, as a checkpoint names
    them: expert ``e``'s gate_proj is rows ``[0, I)`` of ``gate_up_proj[e]``, its up_proj rows
    ``[I, 2 * I)``, its down_proj ``down_proj[e]``."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf == "gate_up_proj":
            inter = tensor.shape[1] // 2
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.gate_proj.weight", tensor[expert, :inter].clone()
                yield f"{prefix}.{expert}.up_proj.weight", tensor[expert, inter:].clone()
        elif prefix.endswith(".mlp.experts") and leaf == "down_proj":
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.down_proj.weight", tensor[expert].clone()
        else:
            yield name, tensor


def save_fused_version(start: Path, target: Path, version: int) -> Path:
    """The weights :func:`fused` yields for ``version``, saved (one tensor per expert) where
    vLLM can load them."""
    from safetensors.torch import save_file

    target.mkdir(parents=True)
    weights = unfused(fused({"model": str(start), "version": version}, refit_index=0))
    save_file(dict(weights), str(target / "model.safetensors"))
    for extra in ("config.json", "generation_config.json"):
        if (start / extra).exists():
            (target / extra).write_bytes((start / extra).read_bytes())
    return target
