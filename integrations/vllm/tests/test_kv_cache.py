"""``clear_kv_caches``: every tensor a layer's ``kv_cache`` binds is zeroed, each once (the
end-to-end case, a NaN-filled cache after a killed refit, is in test_vllm_refit.py)."""

from __future__ import annotations

import torch

from ckpt_vllm.model.kv_cache import clear_kv_caches


class _Layer(torch.nn.Module):
    def __init__(self, kv_cache: object) -> None:
        super().__init__()
        self.kv_cache = kv_cache


def test_every_bound_tensor_is_zeroed_once_and_counted() -> None:
    shared = torch.full((4, 8), float("nan"), dtype=torch.bfloat16)
    states = (torch.full((3,), float("inf")), torch.full((2, 2), -1.0))
    per_engine = [torch.full((5,), 7.0, dtype=torch.float16)]
    linear = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(
        _Layer(shared),
        _Layer(shared),  # bound to two layers (a cache shared across layers): counted once
        _Layer(states),
        _Layer(per_engine),
        _Layer(torch.empty(0)),
        _Layer(None),
        linear,
    )
    weight = linear.weight.detach().clone()

    cleared = clear_kv_caches(model)

    assert cleared == shared.numel() * 2 + 3 * 4 + 4 * 4 + 5 * 2
    for tensor in (shared, *states, *per_engine):
        assert torch.equal(tensor, torch.zeros_like(tensor)), tensor
    assert torch.equal(linear.weight, weight), "a parameter is not a cache"


def test_a_model_without_caches_clears_nothing() -> None:
    assert clear_kv_caches(torch.nn.Linear(3, 3)) == 0
