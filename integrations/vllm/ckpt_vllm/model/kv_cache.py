"""Clearing a worker's KV cache after its weights were not a model.

A refit that fails part-way (a trainer killed, a weight vLLM refuses) leaves the model a mix of
two versions, and the modules vLLM had begun to rebuild may hold memory nothing was written to:
such a model can compute NaN. Whatever it serves meanwhile (``generate(allow_stale=True)``, a
``vllm serve`` client) writes that NaN into KV-cache blocks. Resetting vLLM's prefix cache frees
those blocks but leaves their bytes, and vLLM's CPU attention reads cache bytes a request has
not written yet, masked, where a masked NaN still makes the output NaN (0 * NaN). Seen: after a
killed refit whose model generated only token 0, then a complete refit, the engine's first
generation differed from a fresh engine's and its second did not; with the whole cache filled
with NaN and the prefix cache reset, every token was 0 until the cache was zeroed. So a rank
zeroes its KV cache before it becomes current again after a failed or discarded update
(:func:`clear_kv_caches`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def clear_kv_caches(model: torch.nn.Module) -> int:
    """Zero every KV-cache (and state-cache) tensor the model's layers are bound to; returns the
    bytes zeroed (a tensor bound to several layers counts once). What vLLM binds to a layer's
    ``kv_cache``: a tensor, or a list or tuple of them (per virtual engine, or a state space
    model's states)."""
    cleared: set[tuple[int, int]] = set()
    nbytes = 0
    for tensor in _cache_tensors(model):
        key = (tensor.data_ptr(), tensor.numel())
        if tensor.numel() == 0 or key in cleared:
            continue
        cleared.add(key)
        tensor.zero_()
        nbytes += tensor.numel() * tensor.element_size()
    return nbytes


def _cache_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        bound = vars(module).get("kv_cache")
        if isinstance(bound, torch.Tensor):
            yield bound
        elif isinstance(bound, (list, tuple)):
            yield from (item for item in bound if isinstance(item, torch.Tensor))
