"""One rank of the 2-rank save/load check in test_two_ranks.py (run as a script).

Usage: python _two_rank_worker.py RANK PORT OUT_DIR. Writes OUT_DIR/rank{RANK}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _automodel_helpers import build_llama, full_state, parallelize  # noqa: E402

from ckpt_core.automodel import (  # noqa: E402
    AutomodelCheckpointManager,
    CheckpointingConfig,
    UnrecognizedCheckpointFormatError,
    detect_checkpoint_format,
    iter_saved_tensors,
    saved_safetensors_files,
)


def main(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
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
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
