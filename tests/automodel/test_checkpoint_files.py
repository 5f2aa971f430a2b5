"""Path handling, format detection and config validation: no nemo_automodel, no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402

from ckpt_core.automodel import (  # noqa: E402
    CheckpointingConfig,
    CheckpointNotFoundError,
    EmptyCheckpointDirectoryError,
    UnrecognizedCheckpointFormatError,
    _infer_checkpoint_root,
    detect_checkpoint_format,
    iter_saved_tensors,
    read_checkpoint_keys,
    saved_safetensors_files,
)


@pytest.mark.parametrize(
    ("weights_path", "root"),
    [
        ("/ckpt/step_3/policy/weights/model", "/ckpt/step_3/policy"),
        ("/ckpt/step_3/policy/weights/model/", "/ckpt/step_3/policy"),
        ("/ckpt/step_3/policy/weights/model//", "/ckpt/step_3/policy"),
        ("/ckpt/step_3/policy/weights", "/ckpt/step_3/policy"),
        ("/ckpt/step_3/policy/weights/", "/ckpt/step_3/policy"),
        ("/ckpt/run/model", "/ckpt/run"),
        ("/ckpt/run/model/", "/ckpt/run"),
        ("relative/policy/weights/model", "relative/policy"),
        ("weights", ""),
        ("weights/model", ""),  # NeMo RL's _infer_checkpoint_root returns "" here too
        ("model", ""),
    ],
)
def test_infer_checkpoint_root(weights_path: str, root: str) -> None:
    assert _infer_checkpoint_root(weights_path) == root


def test_infer_checkpoint_root_accepts_pathlike() -> None:
    assert _infer_checkpoint_root(Path("/a/policy/weights/model")) == "/a/policy"


def _tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}


def test_detect_synthetic_safetensors_and_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    st_dir = tmp_path / "st" / "weights" / "model"
    st_dir.mkdir(parents=True)
    save_file(_tensors(), str(st_dir / "shard-00001-model-00001-of-00001.safetensors"))
    assert detect_checkpoint_format(str(tmp_path / "st" / "weights")) == ("safetensors", False)
    assert read_checkpoint_keys(tmp_path / "st" / "weights") == {"w", "b"}
    streamed = dict(iter_saved_tensors(tmp_path / "st" / "weights"))
    assert all(torch.equal(streamed[k], v) for k, v in _tensors().items())

    dcp_dir = tmp_path / "dcp" / "weights" / "model"
    dcp.save(_tensors(), checkpoint_id=str(dcp_dir), no_dist=True)
    assert detect_checkpoint_format(str(dcp_dir.parent)) == ("torch_save", False)
    assert read_checkpoint_keys(dcp_dir) == {"w", "b"}


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as info:
        detect_checkpoint_format(str(tmp_path / "nope"))
    assert isinstance(info.value, FileNotFoundError)


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(EmptyCheckpointDirectoryError, match="is empty"):
        detect_checkpoint_format(str(tmp_path))
    (tmp_path / "model").mkdir()  # weights dir holding only an empty model dir
    with pytest.raises(EmptyCheckpointDirectoryError, match="model"):
        detect_checkpoint_format(str(tmp_path))


def test_unrecognized_directory_lists_what_it_found(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "optim").mkdir()
    with pytest.raises(UnrecognizedCheckpointFormatError, match=r"notes\.txt, optim/") as info:
        detect_checkpoint_format(str(tmp_path))
    assert isinstance(info.value, ValueError)


def test_file_instead_of_directory(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    with pytest.raises(UnrecognizedCheckpointFormatError, match="is a file"):
        detect_checkpoint_format(str(path))


def test_mixed_dcp_and_safetensors_is_ambiguous(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"")
    save_file(_tensors(), str(tmp_path / "x.safetensors"))
    with pytest.raises(UnrecognizedCheckpointFormatError, match="ambiguous"):
        detect_checkpoint_format(str(tmp_path))


def test_adapter_config_without_weights_is_incomplete(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(UnrecognizedCheckpointFormatError, match="incomplete"):
        detect_checkpoint_format(str(tmp_path))


def test_streaming_refuses_rank_sharded_files(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sharding = {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [1, 0]}})}
    save_file({"w": torch.zeros(1, 3)}, str(model_dir / "shard-00002-model-00001-of-00001.safetensors"), sharding)
    with pytest.raises(UnrecognizedCheckpointFormatError, match="save_consolidated=True"):
        saved_safetensors_files(tmp_path)
    save_file({"w": torch.zeros(1, 3)}, str(model_dir / "shard-00001-model-00001-of-00001.safetensors"))
    with pytest.raises(UnrecognizedCheckpointFormatError, match="split across rank shards"):
        saved_safetensors_files(tmp_path)


def test_checkpointing_config_validation() -> None:
    assert CheckpointingConfig().model_save_format == "safetensors"
    with pytest.raises(ValueError, match="model_save_format"):
        CheckpointingConfig(model_save_format="pickle")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save_consolidated"):
        CheckpointingConfig(save_consolidated="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="save_consolidate'"):
        CheckpointingConfig.from_mapping({"save_consolidate": True})
    cfg = CheckpointingConfig.coerce({"model_save_format": "torch_save"})
    assert cfg == CheckpointingConfig(model_save_format="torch_save")
    assert CheckpointingConfig.coerce(cfg) is cfg
    for bad in (None, "safetensors", 3, ["model_save_format"]):
        with pytest.raises(TypeError, match="checkpointing_cfg"):
            CheckpointingConfig.coerce(bad)


NEMO_RL_MAPPING = {
    "enabled": True,
    "checkpoint_dir": "results/grpo",
    "metric_name": "val:reward",
    "higher_is_better": True,
    "save_period": 10,
    "keep_top_k": 3,
    "ft_keep_latest_k": None,
    "ft_save_period": 100,
    "checkpoint_must_save_by": None,
    "save_optimizer": True,
    "model_save_format": None,
    "save_consolidated": True,
    "model_cache_dir": "",
    "model_repo_id": "",
    "is_peft": False,
    "is_async": False,
}


def test_nemo_rls_whole_checkpointing_config_is_taken() -> None:
    cfg = CheckpointingConfig.coerce(NEMO_RL_MAPPING)
    assert cfg == CheckpointingConfig(save_consolidated=True)  # the manager's keys are ignored
    assert cfg.checkpointer_updates(is_peft=False)["model_save_format"] == "safetensors"


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("save_consolidated", "yes", TypeError, "save_consolidated must be a bool"),
        ("model_save_format", "pickle", ValueError, "model_save_format"),
        ("model_repo_id", 7, TypeError, "model_repo_id must be a str"),
        ("dequantize_base_checkpoint", "no", TypeError, "dequantize_base_checkpoint must be a bool"),
        ("is_async", True, ValueError, "is_async=True is not supported"),
        ("keep_topk", 3, ValueError, r"Unknown CheckpointingConfig keys \['keep_topk'\]"),
    ],
)
def test_the_keys_it_uses_are_still_checked(key: str, value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CheckpointingConfig.from_mapping({**NEMO_RL_MAPPING, key: value})
