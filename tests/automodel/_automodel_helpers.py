"""Helpers shared by the ckpt_core.automodel tests: tiny models, training, comparisons.

Everything runs on CPU from local ``transformers`` configs; nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 128
SEQ = 16
BATCH = 2
_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def llama_config(num_layers: int = 2, tie: bool = False) -> LlamaConfig:
    """A tiny Llama: hidden 32, vocab 128."""
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def build_llama(seed: int, num_layers: int = 2, tie: bool = False) -> LlamaForCausalLM:
    """An unparallelized tiny Llama whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(num_layers, tie))


def parallelize(model: nn.Module, mesh: DeviceMesh, *, tp: bool = True) -> nn.Module:
    """TP (colwise/rowwise) over ``mesh['tp']`` then FSDP2 over ``mesh['dp']``: every parameter a DTensor."""
    layers: Any = model.get_submodule("model.layers")  # a Hugging Face causal LM's decoder layers
    for layer in layers:
        if tp:
            parallelize_module(layer, mesh["tp"], _TP_PLAN)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict tensor as a plain, detached, cloned full tensor."""
    out = {}
    for name, value in model.state_dict().items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = tensor.detach().clone()
    return out


def assert_states_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, and every tensor bit-exact (dtype, shape, values)."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), f"tensor {name} differs"


def batches(seed: int, count: int) -> list[torch.Tensor]:
    """Deterministic token batches."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(count)]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    data: list[torch.Tensor],
) -> list[float]:
    """One optimizer step per batch (causal LM loss); returns the losses."""
    losses = []
    for ids in data:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<pad>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


def require_nemo_automodel() -> None:
    """Skip the calling module unless nemo_automodel is importable."""
    pytest.importorskip("nemo_automodel", reason="needs the automodel extra: pip install 'ckpt-core[automodel]'")
