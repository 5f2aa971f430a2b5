"""What one vLLM worker keeps of each checkpoint weight, derived from its live model.

A tensor-parallel vLLM rank loads only a shard of most weights: rows of the column-parallel
layers (``q/k/v_proj``, ``gate/up_proj``, embeddings, head), columns of the row-parallel ones
(``o_proj``, ``down_proj``), and all of the rest. :func:`derive_weight_layout` reads that from
the model's own modules (their tensor-parallel rank and size, head counts, output sizes and
vocabulary ranges, as vLLM's loaders use them) and from the checkpoint-format shapes vLLM
recorded for reloading, and writes it as a destination layout (:mod:`ckpt_core.refit.layout`),
so that the trainer's engine sends this rank only its shards.

Mixture-of-experts layers (vLLM's ``RoutedExperts``) are described in Hugging Face's per-expert
naming (``experts.<e>.{gate,up,down}_proj.weight``): each rank keeps its tensor-parallel share of
the experts it holds and nothing of the others. Their fused naming, as transformers 5 holds
experts in memory (``experts.gate_up_proj`` ``[E, 2 * I, H]``, gate rows then up rows of each
expert, and ``experts.down_proj`` ``[E, H, I]``; with the model's
``is_fused_checkpoint_transposed``, the last two dimensions swapped), is described beside it
as an alternative naming (:class:`ckpt_core.refit.layout.AlternativeNaming`): a trainer yields
either. A module of a kind not listed here is kept whole: it then arrives entire and vLLM's
own loader takes its part, as without a layout (correct, without the saving). A layer vLLM
wrapped to serve LoRA adapters is described by its base layer, under the checkpoint's name
(:func:`~ckpt_vllm.model.loading.checkpoint_name`).

An FP8 model's scales follow their weights (:func:`scale_kept`): a rank keeps the scales of the
rows or 128x128 blocks it keeps. Its attention layers' quantization scales (``k_scale``,
``v_scale`` and the like) are left out: they are calibration values no trainer makes, which
vLLM keeps when a reload brings none.

:func:`full_weight` puts a received shard back where vLLM's loader reads it: vLLM's loaders
take the full checkpoint tensor and cut their shard themselves.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ckpt_core.errors import WeightLayoutError
from ckpt_core.refit.layout import AlternativeNaming, KeptWeight, WeightLayout, nothing, slices, whole
from ckpt_core.refit.quantize.fp8 import BLOCK_SHAPE
from ckpt_vllm.errors import RolloutLoadError
from ckpt_vllm.model.loading import checkpoint_name

# FP8 scales of a linear layer's weight, in checkpoint format (ckpt_core.refit.quantize.fp8).
_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
# An attention layer's quantization scales (KV cache, query, softmax): calibration values, not
# trained. vLLM's loader accepts a checkpoint without them (QuantizationConfig's
# _ignore_unexpected_suffixes) and its reload keeps the ones it holds, so a refit leaves them
# out: a layout naming them would require every trainer to send them.
_ATTENTION_SCALES = frozenset(
    ["q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point"]
)


def derive_weight_layout(model: torch.nn.Module) -> WeightLayout:
    """The layout of this rank: every checkpoint weight the model loads, with the part of it
    this rank keeps. Call after the model is loaded (vLLM has recorded its checkpoint-format
    shapes then)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    weights: dict[str, KeptWeight] = {}
    scales: dict[str, tuple[int, ...]] = {}  # an FP8 weight's scale -> its shape as recorded
    alternatives: list[AlternativeNaming] = []
    for wrapped_name, module in model.named_modules():
        module_name = checkpoint_name(wrapped_name)  # a layer serving LoRA: its base layer's
        if type(module).__name__ == "RoutedExperts":
            per_expert, fused = _expert_weights(module_name, module)
            weights.update(per_expert)
            alternatives.extend(fused)
            continue
        # Checkpoint-format shapes as vLLM recorded them at load (before post-load processing
        # repacked weights); a parameter registered after that (a bias) has its shape still.
        recorded, _ = get_layerwise_info(module).restore_metadata
        parameters = {name: p for name, p in module.named_parameters(recurse=False)} | dict(recorded)
        if is_deferred_attention_layer(module):
            parameters = {n: p for n, p in parameters.items() if n not in _ATTENTION_SCALES}
        leaf = module_name.rsplit(".", 1)[-1]
        prefix = module_name[: len(module_name) - len(leaf)]
        for param_name, meta in parameters.items():
            shape = tuple(meta.shape)
            parts = packed.get(leaf)
            if param_name in _WEIGHT_SCALES:  # placed once their weights are (below)
                names = [f"{prefix}{part}" for part in parts] if parts else [module_name]
                scales.update({f"{name}.{param_name}": shape for name in names})
                continue
            if parts:  # a fused module: one checkpoint weight per part
                for index, part in enumerate(parts):
                    kept = _fused_part(module, index, param_name, shape)
                    weights[f"{prefix}{part}.{param_name}"] = kept
            else:
                weights[f"{module_name}.{param_name}"] = _kept(module, param_name, shape)
    for name, shape in scales.items():
        weight = weights.get(name.rsplit(".", 1)[0] + ".weight")
        weights[name] = whole(shape) if weight is None else scale_kept(name, shape, weight)
    return WeightLayout(weights, tuple(alternatives))


def scale_kept(name: str, shape: tuple[int, ...], weight: KeptWeight) -> KeptWeight:
    """What a rank keeps of FP8 scale ``name`` (of shape ``shape`` as vLLM recorded it, this
    rank's part of it) given what it keeps of the scale's weight: the scales of the rows and
    columns it keeps. In checkpoint format, as a trainer's quantizing engine sends them
    (:mod:`ckpt_core.refit.quantize.fp8`):

    * ``weight_scale_inv``, one per 128x128 block (``[ceil(rows / 128), ceil(cols / 128)]``):
      the blocks of the kept parts; a part that starts or ends inside a block (other than the
      weight's last, partial one) cuts that block's scale between ranks, and is refused with
      :class:`~ckpt_core.errors.WeightLayoutError` naming the scale.
    * ``weight_scale`` of one value per row (``[rows, 1]``, per-channel): the kept rows; all of
      it when the rank keeps columns (a row-parallel layer) or all of the weight.
    * ``weight_scale`` of one value (per part of a fused weight: per-tensor): that value,
      ``[1]``, when the rank keeps any of the weight."""
    if name.endswith("_scale_inv"):
        full = tuple(math.ceil(size / block) for size, block in zip(weight.shape, BLOCK_SHAPE))
        if not weight.kept or weight.dim is None:
            return whole(full) if weight.kept else nothing(full)
        block, size = BLOCK_SHAPE[weight.dim], weight.shape[weight.dim]
        parts = []
        for offset, length in weight.parts:
            if offset % block or (length % block and offset + length != size):
                raise WeightLayoutError(
                    f"{name}: this rank keeps elements [{offset}, {offset + length}) of dimension {weight.dim} "
                    f"of its weight, which cuts a {BLOCK_SHAPE[0]}x{BLOCK_SHAPE[1]} block: the block's one scale "
                    "cannot be split between ranks (vLLM needs each rank's share to be whole blocks); run "
                    "without shard_expert_weights for this model"
                )
            parts.append((offset // block, math.ceil(length / block)))
        return slices(full, weight.dim, parts)
    if len(shape) == 2 and shape[1] == 1:
        full = (weight.shape[0], 1)
        if weight.kept and weight.dim == 0:
            return slices(full, 0, weight.parts)
        return whole(full) if weight.kept else nothing(full)
    return whole((1,)) if weight.kept else nothing((1,))


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


def full_weight(name: str, tensor: torch.Tensor, kept: KeptWeight) -> torch.Tensor:
    """``tensor`` (what this rank received of weight ``name``) as a tensor of the weight's full
    shape with the received parts where they belong: what vLLM's loaders expect. The other
    elements are never read by them and are left unset. Works for any number of dimensions.

    A tensor of another shape than the layout says this rank receives (``kept.received_shape``)
    raises :class:`~ckpt_vllm.errors.RolloutLoadError` naming the weight and both shapes: the
    rank's layout is its own, checked at init, so it is the received weight that does not fit
    (a sender that did not select by this layout), which is what that error reports. Placing
    it anyway would hand vLLM misplaced rows or fail inside a copy with no weight named."""
    expected = kept.received_shape
    if tuple(tensor.shape) != expected:
        what = "none of it" if expected is None else f"shape {list(expected)}"
        raise RolloutLoadError(
            f"received weight {name!r} with shape {list(tensor.shape)}, but this rank's layout says it receives "
            f"{what} (of the full {list(kept.shape)}): the sender did not select by this rank's layout; "
            "build every engine of the refit, the trainer's too, with the same shard_expert_weights"
        )
    if kept.whole:
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


def _expert_weights(module_name: str, module: Any) -> tuple[dict[str, KeptWeight], list[AlternativeNaming]]:
    """A mixture-of-experts layer's routed experts: in Hugging Face checkpoint naming
    (``<prefix>.<expert>.{gate,up,down}_proj.weight``), every rank keeping its tensor-parallel
    share of the experts it holds (rows of gate/up, columns of down) and nothing of the others;
    and, as alternatives to those, the fused ``<prefix>.gate_up_proj`` and ``<prefix>.down_proj``
    (:func:`_fused_experts`)."""
    prefix = module_name.removesuffix(".routed_experts")
    parallel = module.moe_config.moe_parallel_config
    tp_rank, tp_size = int(parallel.tp_rank), int(parallel.tp_size)
    rows = int(module.intermediate_size_per_partition)
    hidden = int(module.hidden_size)
    full = rows * tp_size
    is_local = getattr(getattr(module, "expert_map_manager", None), "is_local_expert", lambda expert: True)
    local = [bool(is_local(expert)) for expert in range(int(module.global_num_experts))]
    weights: dict[str, KeptWeight] = {}
    for expert, held in enumerate(local):
        names = {f"{prefix}.{expert}.{proj}.weight": proj for proj in ("gate_proj", "up_proj", "down_proj")}
        for name, proj in names.items():
            shape = (hidden, full) if proj == "down_proj" else (full, hidden)
            if not held:
                weights[name] = nothing(shape)
            elif tp_size == 1:
                weights[name] = whole(shape)
            else:
                weights[name] = slices(shape, 1 if proj == "down_proj" else 0, [(tp_rank * rows, rows)])
    if not getattr(module.moe_config, "is_act_and_mul", True):
        return weights, []  # no gate: vLLM names its fused form otherwise (not described here)
    gate_up, down = _fused_experts(module_name, module, local, tp_rank, tp_size, rows, hidden)
    gate_up_names = tuple(n for n in weights if n.endswith((".gate_proj.weight", ".up_proj.weight")))
    down_names = tuple(n for n in weights if n.endswith(".down_proj.weight"))
    return weights, [
        AlternativeNaming(gate_up_names, {f"{prefix}.gate_up_proj": gate_up}),
        AlternativeNaming(down_names, {f"{prefix}.down_proj": down}),
    ]


def _fused_experts(
    module_name: str, module: Any, local: list[bool], tp_rank: int, tp_size: int, rows: int, hidden: int
) -> tuple[KeptWeight, KeptWeight]:
    """What this rank keeps of the fused ``gate_up_proj`` (``[E, 2 * I, H]``) and ``down_proj``
    (``[E, H, I]``; both with their last two dimensions swapped when the module says
    ``is_fused_checkpoint_transposed``), as vLLM's loader reads them: it splits gate_up in two
    halves along the intermediate dimension and each expert's loader cuts its tensor-parallel
    rows of each half (columns of down); with expert parallelism, it loads its own experts whole."""
    experts = len(local)
    full = rows * tp_size
    transposed = bool(getattr(module, "is_fused_checkpoint_transposed", False))
    gate_up_shape = (experts, hidden, 2 * full) if transposed else (experts, 2 * full, hidden)
    down_shape = (experts, full, hidden) if transposed else (experts, hidden, full)
    if all(local):
        if tp_size == 1:
            return whole(gate_up_shape), whole(down_shape)
        start = tp_rank * rows
        gate_up = slices(gate_up_shape, 2 if transposed else 1, [(start, rows), (full + start, rows)])
        return gate_up, slices(down_shape, 1 if transposed else 2, [(start, rows)])
    if tp_size > 1:
        raise WeightLayoutError(
            f"{module_name}: this rank holds {sum(local)} of {experts} experts and a tensor-parallel share "
            f"({tp_rank} of {tp_size}) of each: a part of the fused experts along two dimensions, which a "
            "layout cannot name (vLLM 0.32 never shards experts both ways: expert parallelism sets their "
            "tensor-parallel size to 1); run without shard_expert_weights for this model"
        )
    runs: list[tuple[int, int]] = []  # this rank's experts, as runs of consecutive ones
    for expert, held in enumerate(local):
        if held and runs and sum(runs[-1]) == expert:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif held:
            runs.append((expert, 1))
    if not runs:
        return nothing(gate_up_shape), nothing(down_shape)
    return slices(gate_up_shape, 0, runs), slices(down_shape, 0, runs)


def _fused_rows(module: Any) -> list[int]:
    """The full rows of each part of a fused column-parallel module."""
    return [int(size) for size in module.output_sizes]
