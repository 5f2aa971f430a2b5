"""One rank of the 2-rank save/load check in test_two_ranks.py (run as a script).

Usage: python _two_rank_worker.py RANK OUT_DIR. Writes OUT_DIR/rank{RANK}.json. The ranks meet
through a file in OUT_DIR (no port to race other tests for), and the group's timeout ends a
rank whose peer is gone well before the test's own deadline.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.*
from ckpt_core.automodel import (  # noqa: E402
    AutomodelCheckpointManager,
    CheckpointingConfig,
    UnrecognizedCheckpointFormatError,
    detect_checkpoint_format,
    iter_saved_tensors,
    saved_safetensors_files,
)
from tests.automodel._automodel_helpers import build_llama, full_state, parallelize  # noqa: E402

# NeMo RL's whole CheckpointingConfig, as its config files spell it (its manager's keys too).
NEMO_RL_CHECKPOINTING = {
    "enabled": True,
    "checkpoint_dir": "results/grpo",
    "metric_name": "val:accuracy",
    "higher_is_better": True,
    "keep_top_k": 3,
    "save_period": 10,
    "checkpoint_must_save_by": None,
    "model_save_format": "safetensors",
    "save_consolidated": False,
    "model_cache_dir": "",
    "model_repo_id": "",
    "is_peft": False,
    "is_async": False,
}


class SlowTokenizer:
    """Stands in for a Hugging Face tokenizer whose files take a while to write."""

    def save_pretrained(self, directory: str) -> None:
        time.sleep(1.5)
        (Path(directory) / "tokenizer.json").write_text("{}")


GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def main(rank: int, out: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=2, timeout=GROUP_TIMEOUT
    )
    try:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        reference = build_llama(seed=0).state_dict()
        model = parallelize(build_llama(seed=0), mesh, tp=False)
        manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
        manager.init_checkpointer()
        result: dict[str, object] = {"rank": rank, "dp_rank": manager._get_dp_rank()}
        for consolidated in (True, False):
            weights = out / f"consolidated-{consolidated}" / "weights"
            cfg = CheckpointingConfig(save_consolidated=consolidated)
            manager.save_checkpoint(model, str(weights), checkpointing_cfg=cfg)
            dist.barrier()
            result[f"format-{consolidated}"] = list(detect_checkpoint_format(str(weights)))
            result[f"files-{consolidated}"] = sorted(
                str(p.relative_to(weights)) for p in weights.rglob("*.safetensors")
            )
            try:
                streamed = dict(iter_saved_tensors(weights))
                result[f"stream-{consolidated}"] = sorted(streamed) == sorted(reference) and all(
                    torch.equal(streamed[k], reference[k]) for k in reference
                )
            except UnrecognizedCheckpointFormatError as exc:
                result[f"stream-{consolidated}"] = f"refused: {exc}"
            fresh = parallelize(build_llama(seed=1), mesh, tp=False)
            AutomodelCheckpointManager(mesh["dp"], mesh["tp"]).load_checkpoint(fresh, str(weights))
            loaded = full_state(fresh)
            result[f"load-{consolidated}"] = all(torch.equal(loaded[k], reference[k]) for k in reference)
        result["consolidated_files"] = [str(p) for p in saved_safetensors_files(out / "consolidated-True" / "weights")]
        tokenizer_dir = out / "nemo-rl" / "tokenizer"
        manager.save_checkpoint(
            model,
            str(out / "nemo-rl" / "weights"),
            tokenizer=SlowTokenizer(),  # type: ignore[arg-type]
            tokenizer_path=str(tokenizer_dir),
            checkpointing_cfg=NEMO_RL_CHECKPOINTING,  # type: ignore[arg-type]
        )
        result["tokenizer_written_on_return"] = (tokenizer_dir / "tokenizer.json").exists()
        result["nemo-rl-format"] = list(detect_checkpoint_format(str(out / "nemo-rl" / "weights")))
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
