"""Weights made while the refit runs, as a trainer makes them: the bench's ``--produce`` modes.

A trainer does not hold its rollout weights ready: each is made when the refit asks for it (an
fp32 master cast to bf16, a sharded parameter gathered, a quantized copy), so a refit is only
as fast as it hides that work behind the transfer. :func:`produced_weights` wraps another
weights factory and makes every tensor anew as it is yielded:

* ``cast-bf16``: from fp32 master copies of the source's floating-point tensors (made once per
  process, before anything is measured), each yielded as a new bf16 tensor; other dtypes are
  yielded as fresh copies.
* ``fill``: a new tensor of the source tensor's shape and dtype, allocated, then filled from it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_core.bench import PRODUCE_MODES
from ckpt_core.orchestration.workload import load_target


def produced_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params = {"mode": "cast-bf16" | "fill", "source": "module:function", "source_params": {...}}``:
    the source's tensors, each made anew when it is asked for (see the module docstring)."""
    mode = params["mode"]
    if mode not in PRODUCE_MODES:
        raise ValueError(f"produce mode must be one of {', '.join(PRODUCE_MODES)}, got {mode!r}")
    source = (str(params["source"]), json.dumps(params.get("source_params", {}), sort_keys=True), rank)
    if mode == "cast-bf16":
        for name, master in _masters(*source):
            yield name, master.to(torch.bfloat16) if master.is_floating_point() else master.clone()
    else:
        for name, tensor in _source(*source):
            yield name, torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


@functools.lru_cache(maxsize=1)
def _source(target: str, params_json: str, rank: int) -> tuple[tuple[str, torch.Tensor], ...]:
    return tuple(load_target(target)(json.loads(params_json), refit_index=0, rank=rank))


@functools.lru_cache(maxsize=1)
def _masters(target: str, params_json: str, rank: int) -> tuple[tuple[str, torch.Tensor], ...]:
    """The trainer's fp32 master weights: the source's floating-point tensors as fp32."""
    return tuple(
        (name, tensor.float() if tensor.is_floating_point() else tensor.clone())
        for name, tensor in _source(target, params_json, rank)
    )
