"""Weights factories for tests and benchmarks: a transformer-shaped state dict, and the
tensors of a real safetensors checkpoint streamed lazily.

Both are ``"module:function"`` targets for :mod:`ckpt_core.orchestration.workload`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def transformer_shapes(total_bytes: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of a decoder-only transformer of about ``total_bytes``.

    Mixed bf16 matrices and fp32 norms, with an embedding larger than the rest, as in real
    checkpoints; the hidden size grows with the total so layers stay a realistic shape.
    """
    if total_bytes < 1:
        raise ValueError(f"total_bytes must be >= 1, got {total_bytes}")
    hidden = 256
    while hidden < 8192 and 12 * (2 * hidden * hidden) * 8 < total_bytes:
        hidden *= 2
    vocab = 8 * hidden
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * 4 * hidden) + 2 * 4 * hidden
    embed_bytes = 2 * vocab * hidden
    layers = max(1, (total_bytes - 2 * embed_bytes) // layer_bytes)
    shapes: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("model.embed_tokens.weight", (vocab, hidden), torch.bfloat16)
    ]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,), torch.float32),
            (p + "self_attn.q_proj.weight", (hidden, hidden), torch.bfloat16),
            (p + "self_attn.k_proj.weight", (hidden, hidden), torch.bfloat16),
            (p + "self_attn.v_proj.weight", (hidden, hidden), torch.bfloat16),
            (p + "self_attn.o_proj.weight", (hidden, hidden), torch.bfloat16),
            (p + "post_attention_layernorm.weight", (hidden,), torch.float32),
            (p + "mlp.gate_proj.weight", (4 * hidden, hidden), torch.bfloat16),
            (p + "mlp.up_proj.weight", (4 * hidden, hidden), torch.bfloat16),
            (p + "mlp.down_proj.weight", (hidden, 4 * hidden), torch.bfloat16),
        ]
    shapes += [
        ("model.norm.weight", (hidden,), torch.float32),
        ("lm_head.weight", (vocab, hidden), torch.bfloat16),
    ]
    return shapes


@functools.lru_cache(maxsize=2)
def _materialize(total_bytes: int, seed: int) -> tuple[tuple[str, torch.Tensor], ...]:
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for name, shape, dtype in transformer_shapes(total_bytes):
        # Random bits, not random floats: fast to make, and every byte pattern is exercised.
        raw = torch.randint(
            -(2**31),
            2**31 - 1,
            (max(1, torch.Size(shape).numel() * dtype.itemsize // 4 + 1),),
            dtype=torch.int32,
            generator=generator,
        )
        data = raw.view(torch.uint8)[: torch.Size(shape).numel() * dtype.itemsize]
        tensors.append((name, data.view(dtype).reshape(shape).clone()))
    return tuple(tensors)


def transformer_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params = {"size_bytes": int, "seed": int = 0}``: the same tensors every refit
    (materialized once per process), so a benchmark measures the transfer, not the generator."""
    yield from _materialize(int(params["size_bytes"]), int(params.get("seed", 0)))


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files holding one whole copy of a checkpoint's tensors.

    ``path`` may be a file; a Hugging Face model directory; a directory saved by
    :class:`ckpt_core.automodel.AutomodelCheckpointManager` (its consolidated output, or its
    whole-tensor shards); or a directory of shards. Errors (a missing or empty directory, a
    DCP checkpoint, shards that split tensors) are those of
    :func:`ckpt_core.automodel.saved_safetensors_files`.
    """
    from ckpt_core.automodel.checkpoint_files import saved_safetensors_files

    root = Path(path)
    if root.is_file():
        return [root]
    return saved_safetensors_files(root)


def safetensors_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params = {"path": str}``: every tensor of the checkpoint, read one at a time with
    ``safe_open`` (never the whole checkpoint in memory)."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError("reading safetensors checkpoints needs: pip install 'ckpt-core[bench]'") from exc
    for file in safetensors_files(params["path"]):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
