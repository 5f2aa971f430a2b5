"""A refit from a durable checkpoint: `ckpt-engine bench --model` streams a directory that
AutomodelCheckpointManager saved in safetensors format, and moves its tensors bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.automodel._automodel_helpers import build_llama, full_state, parallelize, require_nemo_automodel

require_nemo_automodel()

from ckpt_core.automodel import AutomodelCheckpointManager, CheckpointingConfig  # noqa: E402


def test_bench_moves_a_saved_checkpoint_bit_exact(mesh, tmp_path: Path) -> None:
    model = parallelize(build_llama(seed=3), mesh)
    weights_path = tmp_path / "policy" / "weights"
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer()
    manager.save_checkpoint(
        model,
        str(weights_path),
        checkpointing_cfg=CheckpointingConfig(model_save_format="safetensors", save_consolidated=False),
    )
    result_file = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckpt_core.cli",
            "bench",
            "--model",
            str(weights_path),
            "--policy",
            "1",
            "--rollout",
            "1",
            "--refits",
            "1",
            "--bucket-size",
            "64KiB",
            "--no-baseline",
            "--no-progress",
            "--timeout",
            "60",
            "--json",
            str(result_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "bit-exact" in run.stdout
    result = json.loads(result_file.read_text())
    expected = full_state(model)
    assert result["tensors"] == len(expected)
    assert result["payload_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
