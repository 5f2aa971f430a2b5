"""A trainer for the tests: a tiny Qwen2 trained with real optimizer steps, sending its weights
through a ckpt-core engine. Served in its own process by ``LocalProcessPool`` (so a test can
kill it), called with the same method names as ``RefitWorker``."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ckpt_core.orchestration.workload import digests
from ckpt_core.registry import create_checkpoint_engine

TINY_QWEN2 = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,  # head_dim 256 / 4 = 64: vLLM's CPU attention refuses 16
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def save_tiny_qwen2(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random tiny Qwen2 saved in bf16 (what vLLM loads at start-up)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**{**TINY_QWEN2, **overrides})
    model = transformers.Qwen2ForCausalLM(config).bfloat16()
    model.save_pretrained(str(path))
    return Path(path)


LORA_TARGETS = ("q_proj", "v_proj")


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trained low-rank update, as PEFT's LoRA computes it:
    ``base(x) + x A^T B^T * alpha / r``, ``A`` drawn as PEFT draws it, ``B`` zeros."""

    def __init__(self, base: torch.nn.Linear, r: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Parameter(torch.empty(r, base.in_features))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=5**0.5)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class TinyTrainer:
    """fp32 master weights trained with AdamW on random token batches; refits send them cast
    to bf16, the dtype vLLM serves. Deterministic for a seed: the same steps give the same W."""

    def __init__(
        self,
        *,
        model_dir: str,
        backend: str,
        bucket_size: int,
        engine_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        import transformers

        torch.manual_seed(seed)
        self.model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.vocab = self.model.config.vocab_size
        self.rank = rank
        self.backend, self.bucket_size, self.engine_kwargs = backend, bucket_size, dict(engine_kwargs or {})
        self.engine = self._new_engine()
        self.vllm_engine: Any = None  # a CkptTrainerWeightTransferEngine, after connect_vllm

    def _new_engine(self) -> Any:
        return create_checkpoint_engine(
            self.backend, bucket_size_bytes=self.bucket_size, engine_kwargs=dict(self.engine_kwargs)
        )

    def train(self, *, steps: int = 1, lr: float | None = None) -> float:
        """``steps`` optimizer steps on random sequences (at learning rate ``lr`` from now on,
        where given); the last loss."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        loss = torch.tensor(0.0)
        for _ in range(steps):
            tokens = torch.randint(0, self.vocab, (4, 32))
            loss = self.model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        return float(loss)

    def add_lora(self, *, r: int = 8, alpha: float = 16.0, seed: int = 1) -> dict[str, Any]:
        """Freeze the model and put a LoRA adapter on every ``LORA_TARGETS`` projection; from now
        on :meth:`train` trains only the adapter. Its PEFT config."""
        torch.manual_seed(seed)
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.lora: dict[str, LoraLinear] = {}
        for index, layer in enumerate(self.model.model.layers):
            for target in LORA_TARGETS:
                wrapped = LoraLinear(getattr(layer.self_attn, target), r, alpha)
                setattr(layer.self_attn, target, wrapped)
                self.lora[f"model.layers.{index}.self_attn.{target}"] = wrapped
        self.optimizer = torch.optim.AdamW([p for m in self.lora.values() for p in (m.lora_A, m.lora_B)], lr=1e-2)
        self.lora_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": r,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "target_modules": list(LORA_TARGETS),
            "bias": "none",
            "fan_in_fan_out": False,
        }
        return self.lora_config

    def lora_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter's tensors under PEFT's names (what ``save_pretrained`` of a PEFT model writes)."""
        for module, layer in self.lora.items():
            yield f"base_model.model.{module}.lora_A.weight", layer.lora_A.detach()
            yield f"base_model.model.{module}.lora_B.weight", layer.lora_B.detach()

    def save_lora(self, *, path: str) -> str:
        """The adapter as PEFT saves it (``adapter_config.json``, ``adapter_model.safetensors``)."""
        import json

        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "adapter_config.json").write_text(json.dumps(self.lora_config))
        save_file(
            {name: t.contiguous() for name, t in self.lora_weights()}, str(Path(path) / "adapter_model.safetensors")
        )
        return path

    def refit_lora(self, *, extra: dict[str, list[int]] | None = None, skip: str | None = None) -> int:
        """Send the adapter's tensors through the engine (``extra``: name -> shape of more
        tensors; ``skip``: a tensor left out); how many were sent."""
        sent = self._lora_sent(extra, skip)
        asyncio.run(self.engine.send_weights(iter(sent)))
        return len(sent)

    def send_vllm_lora(
        self, *, name: str, version: str, extra: dict[str, list[int]] | None = None, skip: str | None = None
    ) -> list[dict[str, Any]]:
        """One adapter refit of the server :meth:`connect_vllm` reached (``extra``, ``skip``: as
        in :meth:`refit_lora`); the workers' accounts."""
        return self.vllm_engine.send_adapter(
            name, self._lora_sent(extra, skip), config=self.lora_config, version=version
        )

    def _lora_sent(self, extra: dict[str, list[int]] | None, skip: str | None) -> list[tuple[str, torch.Tensor]]:
        sent = [(n, t) for n, t in self.lora_weights() if n != skip]
        return sent + [(name, torch.zeros(shape)) for name, shape in (extra or {}).items()]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The bf16 weights, each cast as it is yielded (as a trainer produces them)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().to(torch.bfloat16)

    def digests(self) -> dict[str, str]:
        """Name -> digest of each weight a refit would send now."""
        return digests(self.weights())

    def save(self, *, path: str) -> str:
        """W as vLLM would load it from disk (bf16 safetensors plus config)."""
        state = dict(self.weights())
        self.model.save_pretrained(path, state_dict=state)
        return path

    def prepare(self) -> Any:
        return self.engine.prepare()

    def init(self, *, train_world_size: int, rollout_world_size: int, metadata: list[Any]) -> None:
        self.engine.init_policy_process_group(
            worker_rank=self.rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )

    def connect(self, *, rendezvous: str, rollout_world_size: int, timeout_s: float = 120.0) -> None:
        """``prepare()``, the metadata of every worker from ``rendezvous``, then
        ``init_policy_process_group``: how a policy worker meets vLLM's workers that
        ``init_weight_transfer_engine`` sent to the same rendezvous."""
        from ckpt_core.orchestration.rendezvous import exchange_metadata

        metadata = exchange_metadata(
            rendezvous,
            role="policy",
            rank=self.rank,
            entry=self.engine.prepare(),
            train_world_size=1,
            rollout_world_size=rollout_world_size,
            timeout_s=timeout_s,
        )
        self.init(train_world_size=1, rollout_world_size=rollout_world_size, metadata=metadata)

    def refit(self, *, refit_index: int = 0, **faults: Any) -> dict[str, Any]:
        """Send the weights through the seed lifecycle's engine (``faults``: see :meth:`_source`)."""
        asyncio.run(self.engine.send_weights(self._source(**faults)))
        return self._sent(**faults)

    def connect_vllm(
        self,
        *,
        url: str,
        rollout_world_size: int,
        engine_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
        world_size: int = 1,
        rendezvous_port: int = 0,
    ) -> None:
        """Connect to the vLLM server at ``url`` as vLLM's RL tooling does: its factory and HTTP
        client, with ckpt-engine's trainer init info (this trainer's backend, bucket size and
        rank, of ``world_size`` trainer ranks meeting at rank 0's ``rendezvous_port``)."""
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

        from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo

        if self.vllm_engine is not None:
            self.vllm_engine.shutdown()
        info = CkptTrainerInitInfo(
            rank=self.rank,
            transport=self.backend,
            bucket_size_bytes=self.bucket_size,
            rollout_world_size=rollout_world_size,
            engine_kwargs=dict(self.engine_kwargs if engine_kwargs is None else engine_kwargs),
            timeout_s=timeout_s,
            world_size=world_size,
            rendezvous_port=rendezvous_port,
        )
        client = HTTPVLLMWeightSyncClient(url, timeout=timeout_s + 60)
        self.vllm_engine = WeightTransferTrainerFactory.trainer_init(info, client=client)

    def send_vllm(self, *, weight_version: str, **faults: Any) -> dict[str, Any]:
        """One refit of the server :meth:`connect_vllm` reached (``faults``: see :meth:`_source`)."""
        self.vllm_engine.send_weights(self._source(**faults), weight_version=weight_version)
        return self._sent(**faults)

    def _source(
        self,
        *,
        die_after: int | None = None,
        extra: list[dict[str, Any]] | None = None,
        reshape: str | None = None,
        skip: str | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights, with faults for the tests: ``die_after`` N weights the process SIGKILLs
        itself mid-refit; ``extra`` adds ``{"name", "shape"}`` weights; ``reshape`` sends that
        weight with one more row; ``skip`` leaves that weight out."""
        for count, (name, tensor) in enumerate(self.weights()):
            if die_after is not None and count == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if name == skip:
                continue
            if name == reshape:
                tensor = torch.cat([tensor, tensor[:1]])
            yield name, tensor
        for spec in extra or []:
            yield spec["name"], torch.zeros(spec["shape"], dtype=torch.bfloat16)

    def _sent(self, *, extra: list[dict[str, Any]] | None = None, skip: str | None = None, **_: Any) -> dict[str, Any]:
        sent = len(self.model.state_dict()) + len(extra or []) - (skip is not None)
        return {"role": "policy", "rank": self.rank, "tensors": sent, "digests": self.digests()}

    def commit(self, *, weight_version: int) -> None:
        return None

    def reset(self) -> None:
        try:
            self.engine.finalize()
        finally:
            self.engine = self._new_engine()

    def finalize(self) -> None:
        self.engine.finalize()
        if self.vllm_engine is not None:
            self.vllm_engine.shutdown()
