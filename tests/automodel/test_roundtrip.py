"""Save/load round trips on the real nemo_automodel Checkpointer (1-rank Gloo, CPU, DTensor model).

Each (format, save_consolidated) case trains a TP+FSDP2 tiny Llama for a few steps,
saves weights + optimizer + LR scheduler, then keeps training. The tests load that
checkpoint into a freshly built model and optimizer and require bit-exact weights and
an identical continuation (same losses, same final weights, same learning rate).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from ckpt_core.automodel import (  # noqa: E402
    AutomodelCheckpointManager,
    CheckpointingConfig,
    detect_checkpoint_format,
    iter_saved_tensors,
    saved_safetensors_files,
)

CASES = [
    pytest.param(("safetensors", True), id="safetensors-consolidated"),
    pytest.param(("safetensors", False), id="safetensors-sharded"),
    pytest.param(("torch_save", True), id="torch_save-consolidated"),
    pytest.param(("torch_save", False), id="torch_save-plain"),
]
SAVE_STEPS, CONTINUE_STEPS = 3, 3


@dataclass
class SavedRun:
    """A checkpoint on disk plus what the original run did after saving it."""

    fmt: str
    consolidated: bool
    weights_path: Path
    optimizer_path: Path
    saved_state: dict[str, torch.Tensor]
    continue_data: list[torch.Tensor]
    continued_losses: list[float]
    continued_state: dict[str, torch.Tensor]
    continued_lr: list[Any]  # what LRScheduler.get_last_lr() returns (floats, or tensors)


@pytest.fixture(scope="module", params=CASES)
def saved_run(request: pytest.FixtureRequest, mesh, tmp_path_factory: pytest.TempPathFactory) -> SavedRun:
    fmt, consolidated = request.param
    model = parallelize(build_llama(seed=0), mesh)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    train(model, optimizer, scheduler, batches(seed=1, count=SAVE_STEPS))

    root = tmp_path_factory.mktemp(f"{fmt}-{consolidated}")
    weights_path, optimizer_path = root / "policy" / "weights", root / "policy" / "optimizer"
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    manager.save_checkpoint(
        model,
        str(weights_path),
        optimizer=optimizer,
        optimizer_path=str(optimizer_path),
        scheduler=scheduler,
        tokenizer=make_tokenizer(),
        checkpointing_cfg=CheckpointingConfig(model_save_format=fmt, save_consolidated=consolidated),
    )
    saved_state = full_state(model)
    continue_data = batches(seed=2, count=CONTINUE_STEPS)
    losses = train(model, optimizer, scheduler, continue_data)
    return SavedRun(
        fmt, consolidated, weights_path, optimizer_path, saved_state, continue_data, losses,
        full_state(model), scheduler.get_last_lr(),
    )  # fmt: skip


def _fresh(mesh):
    model = parallelize(build_llama(seed=123), mesh)
    optimizer = make_optimizer(model)
    return model, optimizer, make_scheduler(optimizer)


def test_load_restores_weights_and_training_continues_identically(saved_run: SavedRun, mesh) -> None:
    model, optimizer, scheduler = _fresh(mesh)
    assert not torch.equal(full_state(model)["lm_head.weight"], saved_run.saved_state["lm_head.weight"])

    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.load_checkpoint(
        model,
        str(saved_run.weights_path),
        optimizer=optimizer,
        optimizer_path=str(saved_run.optimizer_path),
        scheduler=scheduler,
    )
    assert_states_equal(full_state(model), saved_run.saved_state)
    assert scheduler.last_epoch == SAVE_STEPS

    losses = train(model, optimizer, scheduler, saved_run.continue_data)
    assert losses == saved_run.continued_losses
    assert_states_equal(full_state(model), saved_run.continued_state)
    assert scheduler.get_last_lr() == saved_run.continued_lr


def test_weights_only_load_via_model_dir_with_trailing_slash(saved_run: SavedRun, mesh) -> None:
    model, optimizer, scheduler = _fresh(mesh)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    # A manager initialized for the other format must still load: the format is detected from disk.
    other = "torch_save" if saved_run.fmt == "safetensors" else "safetensors"
    manager.init_checkpointer({"model_save_format": other})
    manager.load_checkpoint(model, str(saved_run.weights_path / "model") + os.sep)
    assert_states_equal(full_state(model), saved_run.saved_state)
    assert optimizer.state == {} and scheduler.last_epoch == 0  # untouched without optimizer_path


def test_detect_checkpoint_format_on_saved_layout(saved_run: SavedRun) -> None:
    expected = (saved_run.fmt, False)
    assert detect_checkpoint_format(str(saved_run.weights_path)) == expected
    assert detect_checkpoint_format(str(saved_run.weights_path) + "/") == expected
    assert detect_checkpoint_format(str(saved_run.weights_path / "model")) == expected
    if saved_run.fmt == "safetensors" and saved_run.consolidated:
        assert detect_checkpoint_format(str(saved_run.weights_path / "model" / "consolidated")) == expected


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_on_disk_layout(saved_run: SavedRun) -> None:
    model_dir = saved_run.weights_path / "model"
    files = _files(model_dir)
    assert {".metadata", "__0_0.distcp"} <= _files(saved_run.optimizer_path / "optim")
    if saved_run.fmt == "torch_save":
        assert {".metadata", "__0_0.distcp"} <= files
        assert not any(f.endswith(".safetensors") for f in files)
        assert "tokenizer.json" in files  # nemo_automodel writes none for DCP; the manager puts it beside
        return
    assert "shard-00001-model-00001-of-00001.safetensors" in files
    assert {".hf_metadata/config.json", ".hf_metadata/tokenizer.json"} <= files
    consolidated = {f for f in files if f.startswith("consolidated/")}
    if saved_run.consolidated:
        assert {
            "consolidated/config.json",
            "consolidated/model.safetensors.index.json",
            "consolidated/model-00001-of-00001.safetensors",
            "consolidated/tokenizer.json",
        } <= consolidated
        index = json.loads((model_dir / "consolidated" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(saved_run.saved_state)
    else:
        assert not consolidated


def test_streaming_helper_yields_every_saved_tensor(saved_run: SavedRun) -> None:
    if saved_run.fmt == "torch_save":
        with pytest.raises(ValueError, match="torch_save"):
            saved_safetensors_files(saved_run.weights_path)
        return
    files = saved_safetensors_files(saved_run.weights_path)
    subdir = "consolidated" if saved_run.consolidated else "model"
    assert files and all(f.parent.name == subdir for f in files)
    streamed = dict(iter_saved_tensors(saved_run.weights_path))
    assert_states_equal(streamed, saved_run.saved_state)
