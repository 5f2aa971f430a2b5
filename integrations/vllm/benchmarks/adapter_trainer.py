"""The LoRA benchmark's trainer (``lora_refit.py``): a process of its own, as an RL framework's
trainer is, holding the base model's weights and two versions of an adapter in memory.

Its imports are light (torch, safetensors, ``ckpt_core``): the local launcher's workers import
this module, and vLLM has no business in a trainer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.transport import BucketedEngine

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
VERSIONS = "AB"


def base_weights(model: str) -> dict[str, torch.Tensor]:
    """The weights of the model saved in folder ``model`` (its ``model.safetensors``)."""
    from safetensors import safe_open

    with safe_open(str(Path(model, "model.safetensors")), framework="pt") as source:
        return {name: source.get_tensor(name) for name in source.keys()}  # noqa: SIM118 - not a dict


def adapter_versions(base: dict[str, torch.Tensor], rank: int) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Two random versions of an adapter on every targeted linear layer, PEFT's names (the same
    in every process: the generator is seeded)."""
    generator = torch.Generator().manual_seed(0)
    versions: dict[str, list[tuple[str, torch.Tensor]]] = {version: [] for version in VERSIONS}
    for name, weight in base.items():
        parts = name.split(".")
        if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in TARGETS.get(parts[-3], ()):
            continue
        module = f"base_model.model.{name.removesuffix('.weight')}"
        out_features, in_features = weight.shape
        for tensors in versions.values():
            tensors.append((f"{module}.lora_A.weight", torch.randn(rank, in_features, generator=generator) * 0.02))
            tensors.append((f"{module}.lora_B.weight", torch.randn(out_features, rank, generator=generator) * 0.02))
    return versions


def merged(base: dict[str, torch.Tensor], adapter: list[tuple[str, torch.Tensor]], scaling: float) -> list[Any]:
    """The model's weights with ``adapter`` merged in, bf16 (what a merged refit sends)."""
    parts = dict(adapter)
    weights = []
    for name, weight in base.items():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        a = parts.get(f"{module}.lora_A.weight")
        if a is not None:
            weight = (weight.float() + parts[f"{module}.lora_B.weight"] @ a * scaling).to(torch.bfloat16)
        weights.append((name, weight))
    return weights


def adapter_weights(params: dict[str, Any], *, refit_index: int, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """A weights factory for ``RefitWorker`` (its ``weights``): the adapter version of refit
    ``refit_index``, versions alternating. :class:`AdapterTrainer` sends by version instead."""
    yield from AdapterTrainer.versions_for(params)[VERSIONS[refit_index % len(VERSIONS)]]


class AdapterTrainer(RefitWorker):
    """A policy ``RefitWorker`` whose ``weights_params`` name the model folder (``model``) and
    the adapter's rank (``lora_rank``); both adapter versions and the base weights are made
    when it starts, so every send finds them ready. Each send starts at ``start_at`` (a
    ``time.perf_counter`` stamp: one clock for every process of a machine) and returns its
    stamps, so the driver times the trainer and vLLM's rank from one start."""

    _made: dict[tuple[str, int], tuple[dict[str, torch.Tensor], dict[str, list[tuple[str, torch.Tensor]]]]] = {}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base, self.versions = self._made_for(self.weights_params)
        self._packed: torch.Tensor | None = None  # pack()'s buffer

    @classmethod
    def _made_for(
        cls, params: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, list[tuple[str, torch.Tensor]]]]:
        key = (str(params["model"]), int(params["lora_rank"]))
        if key not in cls._made:
            base = base_weights(key[0])
            cls._made[key] = (base, adapter_versions(base, key[1]))
        return cls._made[key]

    @classmethod
    def versions_for(cls, params: dict[str, Any]) -> dict[str, list[tuple[str, torch.Tensor]]]:
        return cls._made_for(params)[1]

    def send_adapter(self, *, version: str, start_at: float) -> dict[str, float]:
        """Send adapter ``version`` from ``start_at``: ``{"ended_at", "payload_bytes"}``."""
        adapter = self.versions[version]
        time.sleep(max(0.0, start_at - time.perf_counter()))
        self.engine.send_weights_blocking(item for item in adapter)
        return {"ended_at": time.perf_counter(), "payload_bytes": self._payload_bytes()}

    def pack(self, *, version: str, start_at: float) -> dict[str, float]:
        """From ``start_at``, copy adapter ``version`` into a buffer of this process, as a
        sender packs a bucket (one ``torch.cat`` of its tensors' bytes), and send nothing: the
        trainer's own work in a refit, beside which the driver times vLLM's call. ``{"seconds"}``:
        the copy's."""
        adapter = self.versions[version]
        nbytes = sum(tensor.nbytes for _, tensor in adapter)
        if self._packed is None or self._packed.numel() != nbytes:
            self._packed = torch.empty(nbytes, dtype=torch.uint8)
        time.sleep(max(0.0, start_at - time.perf_counter()))
        started = time.perf_counter()
        torch.cat([tensor.reshape(-1).view(torch.uint8) for _, tensor in adapter], out=self._packed)
        return {"seconds": time.perf_counter() - started}

    def send_merged(self, *, version: str, scaling: float, start_at: float) -> dict[str, float]:
        """Merge adapter ``version`` into the base weights from ``start_at``, then send them
        all: ``{"ended_at", "merge_s", "payload_bytes"}``."""
        time.sleep(max(0.0, start_at - time.perf_counter()))
        started = time.perf_counter()
        weights = merged(self.base, self.versions[version], scaling)
        merge_s = time.perf_counter() - started
        self.engine.send_weights_blocking(item for item in weights)
        return {
            "ended_at": time.perf_counter(),
            "merge_s": merge_s,
            "payload_bytes": self._payload_bytes(),
        }

    def _payload_bytes(self) -> int:
        """The bytes of the engine's last refit (its ``RefitStats``; every transport here is a
        ``BucketedEngine``)."""
        assert isinstance(self.engine, BucketedEngine) and self.engine.last_stats is not None
        return int(self.engine.last_stats.payload_bytes)
