"""What every vLLM benchmark here does around its measurement: the process set-up for two
cores, a scratch folder removed after the run, and the results written as JSON and Markdown."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def set_up_process() -> None:
    """vLLM's workers on core 1 (unless the caller chose), a small KV cache, and this process's
    tensor work on one thread: on two cores, thread pools over both only slow each other down
    (on real machines the trainer and vLLM do not share cores at all)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    torch.set_num_threads(1)


def in_scratch(prefix: str, body: Callable[[Path], T]) -> T:
    """``body(folder)`` in a fresh temporary folder, removed after (models and saved versions:
    several of them per run)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return body(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def write_results(out: Path, name: str, results: dict[str, Any], table: str) -> None:
    """``<out>/<name>.json`` (``results``) and ``<out>/<name>.md`` (``table``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)


def trainer_pool(
    service: str,
    *,
    backend: str,
    bucket_size: int,
    engine_kwargs: dict[str, Any],
    weights: str,
    weights_params: dict[str, Any],
) -> Any:
    """The benchmarks' trainer, a process of its own: a local launcher's pool (a context
    manager) of one policy ``RefitWorker``, ``service`` (``"module:Class"`` of this folder),
    sending ``weights`` (``"module:function"``) on one torch thread, digests off."""
    from ckpt_core.orchestration.local import LocalProcessPool

    policy = {
        "service": service,
        "role": "policy",
        "rank": 0,
        "backend": backend,
        "bucket_size": bucket_size,
        "engine_kwargs": engine_kwargs,
        "verify": False,
        "weights": weights,
        "weights_params": weights_params,
    }
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    return LocalProcessPool([policy], labels=["trainer"], env=env)
