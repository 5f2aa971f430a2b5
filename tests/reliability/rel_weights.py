"""Weights factories for the reliability tests (``"tests.reliability.rel_weights:NAME"`` targets).

Called as ``factory(params, refit_index=..., rank=...)`` in a policy worker; deterministic in
``(params, refit_index)``, so the test process can recompute the source of any refit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_core.testing.weights import slow

Weights = Iterator[tuple[str, torch.Tensor]]


def marked(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """``ckpt_core.testing.weights.slow``, creating the file ``params["marker"]`` once
    ``params["mark_after"]`` tensors have been pulled: then the refit is surely in flight,
    and a test waiting for the file knows when to strike."""
    marker = str(params["marker"])
    mark_after = int(params.get("mark_after", 3))
    for pulled, item in enumerate(slow(params, refit_index=refit_index, rank=rank)):
        if pulled == mark_after:
            with open(marker + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(marker + ".tmp", marker)
        yield item


_CACHE: dict[str, list[tuple[str, torch.Tensor]]] = {}


def cached(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """``params["sizes"]``: byte sizes of ``uint8`` tensors, made once per process and kept;
    each refit only rewrites every tensor's first byte (``refit_index % 256``). For timing
    transfers without timing the making of random data."""
    key = repr(sorted(params.items()))
    if key not in _CACHE:
        g = torch.Generator().manual_seed(int(params.get("seed", 0)))
        _CACHE[key] = [
            (f"cached.{i}", torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=g))
            for i, n in enumerate(params["sizes"])
        ]
    for name, tensor in _CACHE[key]:
        if tensor.numel():
            tensor[0] = refit_index % 256
        yield name, tensor
