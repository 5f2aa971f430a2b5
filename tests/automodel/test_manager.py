"""Manager behaviour: checkpointer lifecycle, config updates, key validation and typed errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.automodel._automodel_helpers import (
    assert_states_equal,
    build_llama,
    full_state,
    parallelize,
    require_nemo_automodel,
)

require_nemo_automodel()

from nemo_automodel.components.checkpoint import CheckpointingConfig as NemoCheckpointingConfig  # noqa: E402
from nemo_automodel.components.checkpoint._backports.filesystem import SerializationFormat  # noqa: E402
from nemo_automodel.components.checkpoint.addons import ConsolidatedHFAddon, PeftAddon  # noqa: E402
from nemo_automodel.components.checkpoint.config import SaveConsolidatedMode  # noqa: E402

from ckpt_core.automodel import (  # noqa: E402
    AutomodelCheckpointManager,
    CheckpointerNotInitializedError,
    CheckpointExistsError,
    CheckpointingConfig,
    CheckpointKeyMismatchError,
    CheckpointNotFoundError,
    EmptyCheckpointDirectoryError,
    UnrecognizedCheckpointFormatError,
)
from ckpt_core.automodel.keys import model_state_dict_keys  # noqa: E402


@pytest.fixture
def manager(mesh) -> AutomodelCheckpointManager:
    return AutomodelCheckpointManager(mesh["dp"], mesh["tp"])


@pytest.fixture(scope="module", params=["torch_save", "safetensors"])
def saved(request, mesh, tmp_path_factory) -> tuple[Path, dict]:
    """A 2-layer model saved in each format, with its exact weights."""
    model = parallelize(build_llama(seed=0), mesh)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    weights = tmp_path_factory.mktemp(request.param) / "weights"
    manager.save_checkpoint(model, str(weights), checkpointing_cfg=CheckpointingConfig(request.param))
    return weights, full_state(model)


def test_ranks_come_from_the_meshes(manager) -> None:
    assert manager._get_dp_rank() == 0 and manager._get_tp_rank() == 0


def test_init_checkpointer_creates_once(manager) -> None:
    assert manager.checkpointer is None and manager.checkpoint_config is None
    manager.init_checkpointer({"model_save_format": "torch_save"}, checkpoint_root="/tmp/ckroot")
    first = manager.checkpointer
    assert first is not None and first.config is manager.checkpoint_config
    assert first.config.model_save_format == SerializationFormat.TORCH_SAVE
    assert first.config.checkpoint_dir == "/tmp/ckroot"
    manager.init_checkpointer({"model_save_format": "safetensors"}, checkpoint_root="/elsewhere")
    assert manager.checkpointer is first
    assert first.config.model_save_format == SerializationFormat.TORCH_SAVE


def test_update_converts_strings_and_rebuilds_addons(manager) -> None:
    manager.update_checkpointer_config({"model_save_format": "torch_save"})  # no checkpointer: no-op
    assert manager.checkpointer is None
    manager.init_checkpointer({"model_save_format": "torch_save"})
    checkpointer = manager.checkpointer
    assert checkpointer is not None and checkpointer._addons == []

    manager.update_checkpointer_config({"model_save_format": "safetensors", "save_consolidated": True}, "/r")
    config = checkpointer.config
    assert config.model_save_format is SerializationFormat.SAFETENSORS
    assert config.save_consolidated is SaveConsolidatedMode.EVERY
    assert config.checkpoint_dir == "/r"
    assert [type(a) for a in checkpointer._addons] == [ConsolidatedHFAddon]

    manager.update_checkpointer_config({"is_peft": True, "model_save_format": "torch_save"})
    assert config.model_save_format is SerializationFormat.SAFETENSORS  # adapters are always safetensors
    assert [type(a) for a in checkpointer._addons] == [PeftAddon]

    manager.update_checkpointer_config({"is_peft": False, "save_consolidated": "false"})
    assert config.save_consolidated is SaveConsolidatedMode.FALSE
    assert [type(a) for a in checkpointer._addons] == [ConsolidatedHFAddon]


def test_bad_config_updates(manager) -> None:
    with pytest.raises(ValueError, match="save_consolidate'"):
        manager.init_checkpointer({"save_consolidate": True})
    with pytest.raises(ValueError, match="model_save_format"):
        manager.init_checkpointer({"model_save_format": "pickle"})
    manager.init_checkpointer()
    with pytest.raises(ValueError, match="save_consolidated"):
        manager.update_checkpointer_config({"save_consolidated": "sometimes"})


def test_save_before_init_is_refused(manager, mesh, tmp_path: Path) -> None:
    model = parallelize(build_llama(seed=0), mesh)
    with pytest.raises(CheckpointerNotInitializedError, match=r"init_checkpointer\(\)") as info:
        manager.save_checkpoint(model, str(tmp_path / "w"), checkpointing_cfg=CheckpointingConfig())
    assert isinstance(info.value, RuntimeError)
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "bad",
    [None, "safetensors", 42, NemoCheckpointingConfig(model_save_format="torch_save")],
    ids=["none", "str", "int", "nemo-config"],
)
def test_wrong_checkpointing_cfg_type_is_a_type_error(manager, mesh, tmp_path: Path, bad) -> None:
    model = parallelize(build_llama(seed=0), mesh)
    manager.init_checkpointer()
    with pytest.raises(TypeError, match="checkpointing_cfg"):
        manager.save_checkpoint(model, str(tmp_path / "w"), checkpointing_cfg=bad)
    with pytest.raises(ValueError, match="Unknown CheckpointingConfig keys"):
        manager.save_checkpoint(model, str(tmp_path / "w"), checkpointing_cfg={"format": "safetensors"})
    assert not (tmp_path / "w").exists()


def test_save_refuses_to_overwrite(saved, manager, mesh) -> None:
    weights, _ = saved
    before = sorted(p.name for p in (weights / "model").iterdir())
    manager.init_checkpointer()
    model = parallelize(build_llama(seed=1), mesh)
    for fmt in ("torch_save", "safetensors"):
        with pytest.raises(CheckpointExistsError, match="already holds"):
            manager.save_checkpoint(model, str(weights), checkpointing_cfg=CheckpointingConfig(fmt))
    assert sorted(p.name for p in (weights / "model").iterdir()) == before


@pytest.mark.parametrize(("layers", "side"), [(3, "missing"), (1, "unexpected")])
def test_architecture_mismatch_fails_listing_keys(saved, manager, mesh, layers: int, side: str) -> None:
    weights, _ = saved
    model = parallelize(build_llama(seed=1, num_layers=layers), mesh)
    before = full_state(model)
    with pytest.raises(CheckpointKeyMismatchError) as info:
        manager.load_checkpoint(model, str(weights))
    listed = getattr(info.value, side)
    other = "unexpected" if side == "missing" else "missing"
    assert f"model.layers.{2 if layers == 3 else 1}.mlp.up_proj.weight" in listed
    assert getattr(info.value, other) == []
    assert f"{len(listed)} {side}" in str(info.value) and listed[0] in str(info.value)
    assert_states_equal(full_state(model), before)  # nothing was loaded


def test_model_state_dict_keys_are_what_loads_are_checked_against(saved, mesh) -> None:
    weights, saved_state = saved
    model = parallelize(build_llama(seed=1), mesh)
    keys = model_state_dict_keys(model)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"], model_state_dict_keys=[*keys, "extra.weight"])
    with pytest.raises(CheckpointKeyMismatchError, match="'extra.weight'") as info:
        manager.load_checkpoint(model, str(weights))
    assert info.value.missing == ["extra.weight"] and info.value.unexpected == []

    manager.set_model_state_dict_keys([k for k in keys if k != "model.norm.weight"])
    with pytest.raises(CheckpointKeyMismatchError) as info:
        manager.load_checkpoint(model, str(weights))
    assert info.value.unexpected == ["model.norm.weight"] and info.value.missing == []
    assert manager.checkpointer is None  # refused before anything was set up

    manager.set_model_state_dict_keys(keys)
    manager.load_checkpoint(model, str(weights))
    assert_states_equal(full_state(model), saved_state)
    assert manager.checkpointer is not None and manager.checkpointer.config.model_state_dict_keys == keys
    with pytest.raises(TypeError, match="list of str"):
        manager.set_model_state_dict_keys("model.norm.weight")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only str"):
        manager.set_model_state_dict_keys([1, 2])  # type: ignore[list-item]


def test_bad_load_paths(saved, manager, mesh, tmp_path: Path) -> None:
    weights, _ = saved
    model = parallelize(build_llama(seed=1), mesh)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        manager.load_checkpoint(model, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyCheckpointDirectoryError, match="empty"):
        manager.load_checkpoint(model, str(tmp_path / "empty"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.md").write_text("not a checkpoint")
    with pytest.raises(UnrecognizedCheckpointFormatError, match="readme.md"):
        manager.load_checkpoint(model, str(tmp_path / "junk"))
    optimizer = __import__("torch").optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointNotFoundError, match="optimizer"):
        manager.load_checkpoint(model, str(weights), optimizer=optimizer, optimizer_path=str(tmp_path / "opt"))
    assert manager.checkpointer is None  # nothing was configured or loaded before the errors


def test_tied_embeddings_round_trip(mesh, tmp_path: Path) -> None:
    model = parallelize(build_llama(seed=0, tie=True), mesh)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    manager.save_checkpoint(model, str(tmp_path / "w"), checkpointing_cfg=CheckpointingConfig())
    fresh = parallelize(build_llama(seed=1, tie=True), mesh)
    AutomodelCheckpointManager(mesh["dp"], mesh["tp"]).load_checkpoint(fresh, str(tmp_path / "w"))
    assert_states_equal(full_state(fresh), full_state(model))


def test_optimizer_is_saved_only_with_both_object_and_path(manager, mesh, tmp_path: Path) -> None:
    import torch

    model = parallelize(build_llama(seed=0), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    manager.init_checkpointer()
    cfg = CheckpointingConfig("torch_save")
    manager.save_checkpoint(model, str(tmp_path / "a" / "weights"), optimizer=optimizer, scheduler=scheduler,
                            checkpointing_cfg=cfg)  # fmt: skip
    manager.save_checkpoint(model, str(tmp_path / "b" / "weights"), optimizer_path=str(tmp_path / "b" / "opt"),
                            scheduler=scheduler, checkpointing_cfg=cfg)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["weights"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["weights"]
    manager.save_checkpoint(model, str(tmp_path / "c" / "weights"), optimizer=optimizer,
                            optimizer_path=str(tmp_path / "c" / "opt"), checkpointing_cfg=cfg)  # fmt: skip
    assert (tmp_path / "c" / "opt" / "optim" / ".metadata").is_file()
