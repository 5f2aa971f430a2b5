"""What workers refit: weights factories named by ``"module:function"``, and tensor digests.

Coordinators describe work as JSON (a target string and parameters), so the same description
drives a local subprocess, a Ray actor, or a test. A weights factory is called as
``factory(params, refit_index=..., rank=...)`` and returns an iterable of ``(name, tensor)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import xxhash

from ckpt_core.chunking import tensor_bytes
from ckpt_core.tensors import dtype_name

WeightsFactory = Callable[..., Iterable[tuple[str, torch.Tensor]]]


def load_target(target: str) -> Any:
    """Import ``"module:attribute"`` and return the attribute; ``ValueError`` if malformed."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected 'module:attribute', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes: equal digests mean a bit-exact copy."""
    digest = xxhash.xxh3_128()
    digest.update(f"{dtype_name(tensor.dtype)}{list(tensor.shape)}".encode())
    data = tensor_bytes(tensor.cpu())
    if data.numel():
        digest.update(data.numpy().data)
    return digest.hexdigest()


def digests(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Name -> digest for every weight, in iteration order."""
    return {name: tensor_digest(tensor) for name, tensor in weights}
