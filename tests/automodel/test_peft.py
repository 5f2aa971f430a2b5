"""LoRA/PEFT adapter save and load through the manager (1-rank Gloo, CPU, FSDP2 DTensors)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.automodel._automodel_helpers import (
    assert_states_equal,
    batches,
    build_llama,
    full_state,
    make_optimizer,
    make_scheduler,
    make_tokenizer,
    parallelize,
    require_nemo_automodel,
    train,
)

require_nemo_automodel()

from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules  # noqa: E402

from ckpt_core.automodel import (  # noqa: E402
    AutomodelCheckpointManager,
    CheckpointingConfig,
    CheckpointKeyMismatchError,
    detect_checkpoint_format,
    read_checkpoint_keys,
    saved_safetensors_files,
)

BASE_SEED = 0


def peft_config(targets: tuple[str, ...] = ("*.q_proj", "*.v_proj")) -> PeftConfig:
    return PeftConfig(target_modules=list(targets), dim=4, alpha=8, use_triton=False)


def lora_model(mesh, seed: int, targets: tuple[str, ...] = ("*.q_proj", "*.v_proj")) -> torch.nn.Module:
    """Base weights from ``BASE_SEED``; adapter init from ``seed``."""
    model = build_llama(seed=BASE_SEED)
    torch.manual_seed(seed)
    assert apply_lora_to_linear_modules(model, peft_config(targets)) == 4
    return parallelize(model, mesh, tp=False)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in full_state(model).items() if "lora_" in k}


@dataclass
class SavedAdapter:
    weights_path: Path
    optimizer_path: Path
    tokenizer_path: Path
    saved_state: dict[str, torch.Tensor]
    continue_data: list[torch.Tensor]
    continued_losses: list[float]
    continued_state: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def saved_adapter(mesh, tmp_path_factory: pytest.TempPathFactory) -> SavedAdapter:
    model = lora_model(mesh, seed=1)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    train(model, optimizer, scheduler, batches(seed=1, count=3))
    root = tmp_path_factory.mktemp("peft")
    weights, optim, tok = root / "policy" / "weights", root / "policy" / "optimizer", root / "tokenizer"
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    manager.save_checkpoint(
        model,
        str(weights),
        optimizer=optimizer,
        optimizer_path=str(optim),
        scheduler=scheduler,
        tokenizer=make_tokenizer(),
        tokenizer_path=str(tok),
        # torch_save is requested on purpose: adapters are always written as safetensors.
        checkpointing_cfg=CheckpointingConfig(model_save_format="torch_save", save_consolidated=False),
        lora_enabled=True,
        peft_config=peft_config(),
    )
    saved = full_state(model)
    data = batches(seed=2, count=3)
    losses = train(model, optimizer, scheduler, data)
    return SavedAdapter(weights, optim, tok, saved, data, losses, full_state(model))


def test_adapter_layout_and_format(saved_adapter: SavedAdapter) -> None:
    model_dir = saved_adapter.weights_path / "model"
    names = {p.name for p in model_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "automodel_peft_config.json"} <= names
    assert not any(n.endswith(".distcp") for n in names)
    assert (saved_adapter.tokenizer_path / "tokenizer.json").is_file()
    assert "tokenizer.json" not in names  # saved separately, not beside
    assert json.loads((model_dir / "adapter_config.json").read_text())["r"] == 4
    assert detect_checkpoint_format(str(saved_adapter.weights_path)) == ("safetensors", True)
    assert detect_checkpoint_format(str(model_dir) + "/") == ("safetensors", True)
    expected = {k for k in saved_adapter.saved_state if "lora_" in k}
    assert read_checkpoint_keys(saved_adapter.weights_path) == expected
    assert saved_safetensors_files(saved_adapter.weights_path) == [model_dir / "adapter_model.safetensors"]


def test_adapter_round_trip_and_identical_continuation(saved_adapter: SavedAdapter, mesh) -> None:
    model = lora_model(mesh, seed=7)
    assert not torch.equal(*(
        s["model.layers.0.self_attn.q_proj.lora_A.weight"] for s in (full_state(model), saved_adapter.saved_state)
    ))  # fmt: skip
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.load_checkpoint(
        model,
        str(saved_adapter.weights_path),
        optimizer=optimizer,
        optimizer_path=str(saved_adapter.optimizer_path),
        scheduler=scheduler,
    )
    assert_states_equal(full_state(model), saved_adapter.saved_state)  # adapter restored, base untouched
    losses = train(model, optimizer, scheduler, saved_adapter.continue_data)
    assert losses == saved_adapter.continued_losses
    assert_states_equal(full_state(model), saved_adapter.continued_state)


def test_adapter_with_other_targets_is_refused(saved_adapter: SavedAdapter, mesh) -> None:
    base = build_llama(seed=BASE_SEED)
    apply_lora_to_linear_modules(base, peft_config(("*.q_proj", "*.k_proj")))
    model = parallelize(base, mesh, tp=False)
    before = full_state(model)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    with pytest.raises(CheckpointKeyMismatchError) as info:
        manager.load_checkpoint(model, str(saved_adapter.weights_path))
    assert "model.layers.0.self_attn.k_proj.lora_A.weight" in info.value.missing
    assert "model.layers.0.self_attn.v_proj.lora_A.weight" in info.value.unexpected
    assert "k_proj.lora_A" in str(info.value) and "v_proj.lora_A" in str(info.value)
    assert_states_equal(full_state(model), before)  # nothing was loaded


def test_peft_save_requires_peft_config(mesh, tmp_path: Path) -> None:
    model = lora_model(mesh, seed=1)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    with pytest.raises(ValueError, match="peft_config"):
        manager.save_checkpoint(model, str(tmp_path / "w"), checkpointing_cfg=CheckpointingConfig(), lora_enabled=True)
    with pytest.raises(ValueError, match="lora_enabled"):
        manager.save_checkpoint(
            model, str(tmp_path / "w"), checkpointing_cfg=CheckpointingConfig(), peft_config=peft_config()
        )
    assert not (tmp_path / "w").exists()
