"""Weights factories for conformance tests (``"ckpt_core.testing.weights:NAME"`` targets).

Each is called as ``factory(params, refit_index=..., rank=...)`` in a worker process and is
deterministic in ``(params["seed"], refit_index)``: a receiver's digests can be checked
against the sender's, and values change from one refit to the next.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_core.refit import layout
from ckpt_core.refit.delta import copy_bits
from ckpt_core.tensors import dtype_name, transferable_dtypes

Weights = Iterator[tuple[str, torch.Tensor]]


def random_bytes(nbytes: int, generator: torch.Generator) -> torch.Tensor:
    """``nbytes`` random bytes as a 1-D ``uint8`` tensor."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose bytes are random (any bit pattern, NaNs too)."""
    numel = torch.Size(shape).numel()
    return random_bytes(numel * dtype.itemsize, generator).view(dtype).reshape(shape)


def _generator(params: dict[str, Any], refit_index: int, rank: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(int(params.get("seed", 0)) * 1_000_003 + refit_index * 7919 + rank)


def every_dtype(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """One tensor of every byte-movable dtype, plus zero-element, 0-d, non-contiguous and
    bool/int/bf16/float8 edge cases. ``params["elements"]`` sets the size (default 257)."""
    g = _generator(params, refit_index)
    elements = int(params.get("elements", 257))
    for dtype in transferable_dtypes():
        yield f"dtype.{dtype_name(dtype)}", random_tensor((elements,), dtype, g)
    yield "empty.float32", torch.empty(0, dtype=torch.float32)
    yield "empty.2d.bfloat16", torch.empty(3, 0, dtype=torch.bfloat16)
    yield "scalar.float64", random_tensor((), torch.float64, g)
    yield "scalar.bool", torch.tensor(refit_index % 2 == 0)
    yield "scalar.int64", torch.tensor(refit_index - 5, dtype=torch.int64)
    yield "noncontiguous.transposed", random_tensor((7, 5), torch.float32, g).t()
    yield "noncontiguous.strided", random_tensor((40,), torch.bfloat16, g)[::3]
    yield "float8.e4m3fn", random_tensor((33,), torch.float8_e4m3fn, g)


def drifting(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """:func:`every_dtype`'s tensors (made contiguous) at refit 0; at each later refit, the
    lowest bit of a fraction of every tensor's elements flipped, on top of the refits before:
    the small steps delta refits are for. ``params["fractions"]`` are the fractions of refits
    1, 2, ... in turn (default 0, 0.0001, 0.01, 0.1 and 1); ``params["version"]``, where
    given, replaces ``refit_index`` (a run of refits that goes on across re-inits)."""
    fractions = [float(f) for f in params.get("fractions", [0.0, 0.0001, 0.01, 0.1, 1.0])]
    tensors = [(name, copy_bits(t)) for name, t in every_dtype(params, refit_index=0, rank=rank)]
    for step in range(1, int(params.get("version", refit_index)) + 1):
        g = _generator(params, step, rank)
        fraction = fractions[(step - 1) % len(fractions)]
        for _, tensor in tensors:
            count = round(tensor.numel() * fraction)
            if count:
                elements = tensor.reshape(-1).view(torch.uint8).view(tensor.numel(), tensor.element_size())
                elements[torch.randperm(tensor.numel(), generator=g)[:count], 0] ^= 1
    yield from tensors


def sized(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """``params["sizes"]``: byte sizes of uint8/fp32/bf16 tensors to send, in order."""
    g = _generator(params, refit_index)
    dtypes = (torch.float32, torch.bfloat16, torch.uint8)
    for i, nbytes in enumerate(params["sizes"]):
        dtype = dtypes[i % len(dtypes)]
        yield f"sized.{i}", random_tensor((int(nbytes) // dtype.itemsize,), dtype, g)


def tiny(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """``params["count"]`` tensors of ``params.get("nbytes", 16)`` bytes each, named
    ``tiny.<i>``, padded with dots to ``params.get("name_length", 0)`` characters."""
    g = _generator(params, refit_index)
    nbytes = int(params.get("nbytes", 16))
    name_length = int(params.get("name_length", 0))
    data = random_bytes(int(params["count"]) * nbytes, g).view(-1, nbytes)
    for i in range(int(params["count"])):
        yield f"tiny.{i}".ljust(name_length, "."), data[i].view(torch.float32) if nbytes % 4 == 0 else data[i]


def nothing(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """A policy generator that yields no tensor at all."""
    return iter(())


def failing(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """Yields ``params["after"]`` tensors of ``sized``-like data, then raises RuntimeError."""
    g = _generator(params, refit_index)
    for i in range(int(params.get("after", 1))):
        yield f"before_failure.{i}", random_tensor((int(params.get("elements", 1024)),), torch.float32, g)
    raise RuntimeError("weights generator failed on purpose (ckpt_core.testing.weights:failing)")


def slow(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """``params["count"]`` tensors of ``params["nbytes"]`` bytes, sleeping ``params["delay_s"]``
    before each: a refit that is reliably still running when a test kills a peer."""
    g = _generator(params, refit_index)
    for i in range(int(params["count"])):
        time.sleep(float(params["delay_s"]))
        yield f"slow.{i}", random_bytes(int(params["nbytes"]), g)


def rank_dependent(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """Different values on every policy rank (to check that paired ranks are not mixed up)."""
    g = _generator(params, refit_index, rank)
    for i in range(int(params.get("count", 4))):
        yield f"rank_dependent.{i}", random_tensor((int(params.get("elements", 4096)),), torch.float32, g)


def empty_and_scalar(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """Zero-element and 0-d tensors in every position: first, between data, right after a
    tensor that ends exactly on a bucket boundary (``params["bucket_size"]``, default 4096),
    and last. Values of the 0-d tensors change with ``refit_index``."""
    g = _generator(params, refit_index)
    bucket = int(params.get("bucket_size", 4096))
    yield "empty.first", torch.empty(0, dtype=torch.float16)
    yield "scalar.first.float32", random_tensor((), torch.float32, g)
    yield "empty.3x0.int64", torch.empty(3, 0, dtype=torch.int64)
    # After the entries above (the int64 empty is aligned to byte 8) this ends on the boundary.
    yield "fills.to.boundary", random_tensor((bucket - 8,), torch.uint8, g)
    yield "empty.after.boundary", torch.empty(0, 5, 2, dtype=torch.bfloat16)
    for dtype in (torch.bool, torch.int8, torch.float64, torch.complex64, torch.bfloat16):
        yield f"scalar.{dtype_name(dtype)}", random_tensor((), dtype, g)
    yield "data.middle", random_tensor((bucket // 4 + 3,), torch.float32, g)
    yield "empty.between.0", torch.empty(0, dtype=torch.complex128)
    yield "empty.between.1", torch.empty(0, 0, dtype=torch.uint8)
    yield "scalar.int64.refit", torch.tensor(refit_index * 1_000_003 + 7, dtype=torch.int64)
    yield "empty.last", torch.empty(2, 0, 3, dtype=torch.float32)


def slow_marked(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """:func:`slow`, writing the file ``params["marker"]`` once ``params.get("mark_after", 2)``
    tensors have been pulled: a test waits for it to know the refit is in flight."""
    marker = str(params["marker"])
    mark_after = int(params.get("mark_after", 2))
    for pulled, item in enumerate(slow(params, refit_index=refit_index, rank=rank)):
        if pulled == mark_after:
            with open(marker, "w") as f:
                f.write(f"{pulled}\n")
        yield item


def tiny_moe(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """A small mixture-of-experts decoder in Hugging Face naming (Qwen2-MoE-like), the same on
    every policy rank: ``params["layers"]`` (default 2) layers of attention (``q/k/v/o_proj``),
    a router (``mlp.gate``) and ``params["experts"]`` (default 4) experts of ``gate/up/down_proj``,
    bf16, with norms, embeddings and the head. ``params["hidden"]`` (64) and
    ``params["intermediate"]`` (32) set the sizes."""
    g = _generator(params, refit_index)
    hidden, inter = int(params.get("hidden", 64)), int(params.get("intermediate", 32))
    experts, vocab = int(params.get("experts", 4)), int(params.get("vocab", 128))
    bf16 = torch.bfloat16
    yield "model.embed_tokens.weight", random_tensor((vocab, hidden), bf16, g)
    for layer in range(int(params.get("layers", 2))):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", random_tensor((hidden,), bf16, g)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{prefix}.self_attn.{proj}.weight", random_tensor((hidden, hidden), bf16, g)
        yield f"{prefix}.post_attention_layernorm.weight", random_tensor((hidden,), bf16, g)
        yield f"{prefix}.mlp.gate.weight", random_tensor((experts, hidden), bf16, g)
        expert_shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        for expert in range(experts):
            for proj, shape in expert_shapes.items():
                yield f"{prefix}.mlp.experts.{expert}.{proj}.weight", random_tensor(shape, bf16, g)
    yield "model.norm.weight", random_tensor((hidden,), bf16, g)
    yield "lm_head.weight", random_tensor((vocab, hidden), bf16, g)


def tiny_moe_layout(shapes: dict[str, tuple[int, ...]], rank: int, world_size: int) -> layout.WeightLayout:
    """What rank ``rank`` of a tensor- and expert-parallel rollout of ``world_size`` ranks keeps
    of :func:`tiny_moe`'s weights (``shapes``: name -> shape): q/k/v rows and o_proj columns
    split, expert e owned whole by rank ``e % world_size``, everything else replicated."""
    weights: dict[str, layout.KeptWeight] = {}
    for name, shape in shapes.items():
        if ".mlp.experts." in name:
            expert = int(name.split(".mlp.experts.")[1].split(".")[0])
            weights[name] = layout.whole(shape) if expert % world_size == rank else layout.nothing(shape)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            weights[name] = layout.even_shard(shape, 0, rank, world_size)
        elif name.endswith("o_proj.weight"):
            weights[name] = layout.even_shard(shape, 1, rank, world_size)
        else:
            weights[name] = layout.whole(shape)
    return layout.WeightLayout(weights)
