"""Two Gloo ranks (FSDP2 over dp=2): on-disk layout of a sharded save, streaming, and loads.

Each rank is its own interpreter running _two_rank_worker.py; results come back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.automodel._automodel_helpers import require_nemo_automodel

require_nemo_automodel()

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("two-ranks")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",  # two ranks share the CPU cores
    }
    logs = [out / f"rank{rank}.log" for rank in (0, 1)]
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as sink:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "_two_rank_worker.py"), str(rank), str(out)],
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
    try:
        finished = _wait_all(procs, TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert finished, f"the ranks did not finish within {TIMEOUT_S} s:\n{_tail(logs)}"
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{_tail(logs)}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Whether every rank exited, or one failed (its peer would wait for it until the group's
    timeout), before ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
            return True
        time.sleep(0.2)
    return False


def _tail(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name} ---\n{log.read_text()[-3000:]}" for log in logs)


def test_each_rank_has_its_dp_rank(results: list[dict]) -> None:
    assert [r["dp_rank"] for r in results] == [0, 1]


def test_sharded_layout_has_one_file_per_rank(results: list[dict]) -> None:
    for r in results:
        assert r["files-False"] == [
            "model/shard-00001-model-00001-of-00001.safetensors",
            "model/shard-00002-model-00001-of-00001.safetensors",
        ]
        assert r["files-True"] == [
            "model/consolidated/model-00001-of-00001.safetensors",
            *r["files-False"],
        ]
        assert r["format-True"] == r["format-False"] == ["safetensors", False]


def test_streaming_uses_consolidated_output_and_refuses_rank_shards(results: list[dict]) -> None:
    for r in results:
        assert r["stream-True"] is True
        assert r["stream-False"].startswith("refused: ") and "save_consolidated=True" in r["stream-False"]
        assert [Path(p).parent.name for p in r["consolidated_files"]] == ["consolidated"]


def test_every_rank_loads_bit_exact(results: list[dict]) -> None:
    for r in results:
        assert r["load-True"] is True and r["load-False"] is True


def test_nemo_rls_whole_config_saves_and_every_rank_waits_for_the_tokenizer(results: list[dict]) -> None:
    """NeMo RL's checkpointing mapping (its manager's keys included) is taken as it is, and
    rank 1 returns from save_checkpoint only once rank 0 has written the tokenizer."""
    for r in results:
        assert r["nemo-rl-format"] == ["safetensors", False]
        assert r["tokenizer_written_on_return"] is True, f"rank {r['rank']} returned before the tokenizer was written"
