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
