"""``load_base_model`` from a Hugging Face model directory saved locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.automodel._automodel_helpers import (
    assert_states_equal,
    build_llama,
    full_state,
    llama_config,
    parallelize,
    require_nemo_automodel,
)

require_nemo_automodel()

from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from ckpt_core.automodel import (  # noqa: E402
    AutomodelCheckpointManager,
    CheckpointerNotInitializedError,
    CheckpointKeyMismatchError,
)

HF_SEED = 5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama written with ``save_pretrained`` and its exact weights."""
    model = build_llama(seed=HF_SEED)
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def manager(mesh) -> AutomodelCheckpointManager:
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    return manager


def test_load_base_model_into_parallel_model(hf_dir, manager, mesh) -> None:
    directory, weights = hf_dir
    model = parallelize(build_llama(seed=99), mesh)
    manager.load_base_model(model, str(directory))
    assert_states_equal(full_state(model), weights)


def test_load_base_model_materializes_meta_model(hf_dir, manager, mesh) -> None:
    directory, weights = hf_dir
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(llama_config())
    model = parallelize(meta_model, mesh)
    manager.load_base_model(model, str(directory))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_states_equal(full_state(model), weights)


def test_load_base_model_into_lora_model_initializes_adapters(hf_dir, manager, mesh) -> None:
    directory, weights = hf_dir
    base = build_llama(seed=99)
    apply_lora_to_linear_modules(base, PeftConfig(target_modules=["*.q_proj"], dim=4, use_triton=False))
    model = parallelize(base, mesh, tp=False)
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if lora_a is not None:
            torch.nn.init.zeros_(lora_a.weight)
    manager.load_base_model(model, str(directory), peft_init_method="xavier")
    state = full_state(model)
    assert_states_equal({k: v for k, v in state.items() if "lora_" not in k}, weights)
    assert state["model.layers.0.self_attn.q_proj.lora_A.weight"].abs().sum() > 0  # xavier ran


def test_base_checkpoint_with_fewer_layers_is_refused(manager, mesh, tmp_path: Path) -> None:
    small = build_llama(seed=HF_SEED, num_layers=1)
    small.save_pretrained(tmp_path / "one-layer")
    model = parallelize(build_llama(seed=99), mesh)
    before = full_state(model)
    with pytest.raises(CheckpointKeyMismatchError) as info:
        manager.load_base_model(model, str(tmp_path / "one-layer"))
    assert "model.layers.1.self_attn.q_proj.weight" in info.value.missing
    assert not info.value.unexpected
    assert_states_equal(full_state(model), before)


def test_load_base_model_before_init_is_an_assertion_error(hf_dir, mesh) -> None:
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    model = build_llama(seed=1)
    with pytest.raises(AssertionError, match="init_checkpointer"):
        manager.load_base_model(model, str(hf_dir[0]))
    with pytest.raises(CheckpointerNotInitializedError):
        manager.load_base_model(model, str(hf_dir[0]))
