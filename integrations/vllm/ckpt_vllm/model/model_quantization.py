"""What a vLLM worker holds quantized, derived from its live model, as the
``"weight_quantization"`` of its ``prepare()`` metadata (:mod:`ckpt_core.refit.quantize`): a
trainer engine with ``quantize_for_rollout`` then sends those weights as FP8 bytes and scales
made with vLLM's own arithmetic, which vLLM's loader takes as it takes an FP8 checkpoint.

The checkpoint-format parameters vLLM recorded at load (the ones :func:`derive_weight_layout`
lists) say it: a module's ``weight`` with a ``weight_scale`` of one value per row is per-channel
FP8 (compressed-tensors checkpoints), with one value in all per-tensor, and with a
``weight_scale_inv`` 128x128 blocks. A model whose weights are not FP8 holds nothing quantized.

:func:`save_fp8_checkpoint` writes the FP8 checkpoint such an engine starts from, from a BF16
one, with the same arithmetic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ckpt_core.refit.layout import WeightLayout
from ckpt_core.refit.quantize import QuantizationSpec
from ckpt_core.refit.quantize.fp8 import BLOCK_SHAPE, Fp8Format, quantize
from ckpt_vllm.errors import RolloutLoadError


def derive_weight_quantization(layout: WeightLayout, dtype: torch.dtype) -> QuantizationSpec | None:
    """The spec of a model whose checkpoint weights ``layout`` lists (every weight, with its
    full shape), held in ``dtype``; ``None`` when it holds no weight quantized. A model mixing
    formats is refused (one spec has one format)."""
    formats: dict[str, Fp8Format] = {}
    for name, kept in layout.weights.items():
        if not name.endswith(".weight"):
            continue
        rows_cols = tuple(kept.shape)
        scale = layout.weights.get(f"{name}_scale")
        block_scale = layout.weights.get(f"{name}_scale_inv")
        if block_scale is not None and len(rows_cols) == 2:
            expected = tuple(math.ceil(size / block) for size, block in zip(rows_cols, BLOCK_SHAPE))
            if tuple(block_scale.shape) != expected:
                raise RolloutLoadError(
                    f"{name}: its weight_scale_inv has shape {list(block_scale.shape)}, not the {list(expected)} "
                    f"of 128x128 blocks over {list(rows_cols)}: a block size ckpt-engine does not quantize for"
                )
            formats[name] = Fp8Format.BLOCK
        elif scale is not None and len(rows_cols) == 2:
            if math.prod(scale.shape) == 1:
                formats[name] = Fp8Format.PER_TENSOR
            elif tuple(scale.shape) == (rows_cols[0], 1):
                formats[name] = Fp8Format.PER_CHANNEL
            else:
                raise RolloutLoadError(
                    f"{name}: its weight_scale has shape {list(scale.shape)}, neither one value nor one per row of "
                    f"{list(rows_cols)}: a scheme ckpt-engine does not quantize for"
                )
    if not formats:
        return None
    kinds = sorted({fmt.value for fmt in formats.values()})
    if len(kinds) > 1:
        raise RolloutLoadError(f"the model holds weights in more than one FP8 format ({kinds}): one is supported")
    return QuantizationSpec(dtype=dtype, fmt=next(iter(formats.values())), weights=frozenset(formats))


# compressed-tensors' FP8 with per-channel weight scales and dynamic per-token activations
# (llm-compressor's FP8_DYNAMIC scheme), the head left in its dtype.
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
_DECODER_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_fp8_checkpoint(source: Path, target: Path) -> Path:
    """``source`` (a Hugging Face checkpoint of a Llama/Qwen-style decoder, in its model dtype)
    written to the new folder ``target`` as compressed-tensors FP8: each attention and MLP
    projection's weight per-channel FP8 with its ``weight_scale``
    (:mod:`ckpt_core.refit.quantize.fp8`, vLLM's arithmetic), everything else as it was, and
    the config's ``quantization_config``. What an FP8 rollout starts from; ``target``."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.endswith(".weight") and name.split(".")[-2] in _DECODER_LINEAR:
                quantized = quantize(name, tensor, Fp8Format.PER_CHANNEL)
                tensors[name], tensors[quantized.scale_name] = quantized.weight, quantized.scale
            else:
                tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": COMPRESSED_TENSORS_FP8}))
    return target
