"""What one vLLM worker keeps of each checkpoint weight, derived from its live model.

A tensor-parallel vLLM rank loads only a shard of most weights: rows of the column-parallel
layers (``q/k/v_proj``, ``gate/up_proj``, embeddings, head), columns of the row-parallel ones
(``o_proj``, ``down_proj``), and all of the rest. :func:`derive_weight_layout` reads that from
the model's own modules (their tensor-parallel rank and size, head counts, output sizes and
vocabulary ranges, as vLLM's loaders use them) and from the checkpoint-format shapes vLLM
recorded for reloading, and writes it as a destination layout (:mod:`ckpt_core.layout`), so
that the trainer's engine sends this rank only its shards.

Mixture-of-experts layers (vLLM's ``RoutedExperts``) are described in Hugging Face's per-expert
naming (``experts.<e>.{gate,up,down}_proj.weight``): each rank keeps its tensor-parallel share of
the experts it holds and nothing of the others. A module of a kind not listed here is kept
whole: it then arrives entire and vLLM's own loader takes its part, as without a layout
(correct, without the saving). :func:`full_weight` puts a
received shard back where vLLM's loader reads it: vLLM's loaders take the full checkpoint
tensor and cut their shard themselves.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_core.layout import KeptWeight, WeightLayout, nothing, slices, whole


def derive_weight_layout(model: torch.nn.Module) -> WeightLayout:
    """The layout of this rank: every checkpoint weight the model loads, with the part of it
    this rank keeps. Call after the model is loaded (vLLM has recorded its checkpoint-format
    shapes then)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    weights: dict[str, KeptWeight] = {}
    for module_name, module in model.named_modules():
        if type(module).__name__ == "RoutedExperts":
            weights.update(_expert_weights(module_name, module))
            continue
        # Checkpoint-format shapes as vLLM recorded them at load (before post-load processing
        # repacked weights); a parameter registered after that (a bias) has its shape still.
        recorded, _ = get_layerwise_info(module).restore_metadata
        parameters = {name: p for name, p in module.named_parameters(recurse=False)} | dict(recorded)
        leaf = module_name.rsplit(".", 1)[-1]
        prefix = module_name[: len(module_name) - len(leaf)]
        for param_name, meta in parameters.items():
            shape = tuple(meta.shape)
            parts = packed.get(leaf)
            if parts:  # a fused module: one checkpoint weight per part
                for index, part in enumerate(parts):
                    kept = _fused_part(module, index, param_name, shape)
                    weights[f"{prefix}{part}.{param_name}"] = kept
            else:
                weights[f"{module_name}.{param_name}"] = _kept(module, param_name, shape)
    return WeightLayout(weights)


def checkpoint_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters in checkpoint format (its shards and what it
    replicates, before vLLM's post-load processing): what a sharded refit should move to it."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    total = 0
    for module in model.modules():
        recorded, _ = get_layerwise_info(module).restore_metadata
        parameters = {name: p for name, p in module.named_parameters(recurse=False)} | dict(recorded)
        total += sum(p.numel() * p.element_size() for p in parameters.values())
    return total


def full_weight(tensor: torch.Tensor, kept: KeptWeight) -> torch.Tensor:
    """``tensor`` (what this rank received of a weight) as a tensor of the weight's full shape
    with the received parts where they belong: what vLLM's loaders expect. The other elements
    are never read by them and are left unset."""
    if kept.whole or not kept.kept:
        return tensor
    assert kept.dim is not None
    full = torch.empty(kept.shape, dtype=tensor.dtype, device=tensor.device)
    position = 0
    for offset, length in kept.parts:
        full.narrow(kept.dim, offset, length).copy_(tensor.narrow(kept.dim, position, length))
        position += length
    return full


def _kept(module: Any, param_name: str, shape: tuple[int, ...]) -> KeptWeight:
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, VocabParallelEmbedding) and param_name == "weight":
        indices = module.shard_indices
        start, end = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
        return slices((int(module.org_vocab_size), *shape[1:]), 0, [(start, end - start)])
    tp_size, tp_rank = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", 0))
    if tp_size == 1 or param_name not in ("weight", "bias"):
        return whole(shape)
    if isinstance(module, RowParallelLinear):
        if param_name == "bias" or not module.input_is_parallel:
            return whole(shape)
        local = int(module.input_size_per_partition)
        return slices((shape[0], local * tp_size, *shape[2:]), 1, [(tp_rank * local, local)])
    if isinstance(module, ColumnParallelLinear):
        local = int(module.output_size_per_partition)
        return slices((local * tp_size, *shape[1:]), 0, [(tp_rank * local, local)])
    return whole(shape)


def _fused_part(module: Any, index: int, param_name: str, shape: tuple[int, ...]) -> KeptWeight:
    """Part ``index`` of a fused column-parallel module (q/k/v, gate/up): its full rows and
    the rows of them this rank keeps."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    tp_size, tp_rank = int(module.tp_size), int(module.tp_rank)
    if tp_size == 1:
        sizes = _fused_rows(module)
        return whole((sizes[index], *shape[1:]))
    if isinstance(module, QKVParallelLinear):
        head_sizes = [module.head_size, module.head_size, getattr(module, "v_head_size", module.head_size)]
        if index == 0:
            heads, total, shard = module.num_heads, module.total_num_heads, tp_rank
        else:
            heads, total = module.num_kv_heads, module.total_num_kv_heads
            shard = tp_rank // int(module.num_kv_head_replicas)
        rows, full_rows = int(heads) * int(head_sizes[index]), int(total) * int(head_sizes[index])
        return slices((full_rows, *shape[1:]), 0, [(shard * rows, rows)])
    if isinstance(module, MergedColumnParallelLinear):
        full_rows = int(module.output_sizes[index])
        rows = full_rows // tp_size
        return slices((full_rows, *shape[1:]), 0, [(tp_rank * rows, rows)])
    raise NotImplementedError(f"fused module {type(module).__name__} has no known layout")


def _expert_weights(module_name: str, module: Any) -> dict[str, KeptWeight]:
    """A mixture-of-experts layer's routed experts, in Hugging Face checkpoint naming
    (``<prefix>.<expert>.{gate,up,down}_proj.weight``): every rank keeps its tensor-parallel
    share of the experts it holds (rows of gate/up, columns of down), nothing of the others."""
    prefix = module_name.removesuffix(".routed_experts")
    parallel = module.moe_config.moe_parallel_config
    tp_rank, tp_size = int(parallel.tp_rank), int(parallel.tp_size)
    rows = int(module.intermediate_size_per_partition)
    hidden = int(module.hidden_size)
    full = rows * tp_size
    is_local = getattr(getattr(module, "expert_map_manager", None), "is_local_expert", lambda expert: True)
    weights: dict[str, KeptWeight] = {}
    for expert in range(int(module.global_num_experts)):
        names = {f"{prefix}.{expert}.{proj}.weight": proj for proj in ("gate_proj", "up_proj", "down_proj")}
        for name, proj in names.items():
            shape = (hidden, full) if proj == "down_proj" else (full, hidden)
            if not is_local(expert):
                weights[name] = nothing(shape)
            elif tp_size == 1:
                weights[name] = whole(shape)
            else:
                weights[name] = slices(shape, 1 if proj == "down_proj" else 0, [(tp_rank * rows, rows)])
    return weights


def _fused_rows(module: Any) -> list[int]:
    """The full rows of each part of a fused column-parallel module."""
    return [int(size) for size in module.output_sizes]
