"""examples/vllm_rl_loop.py and examples/vllm_serve_rl_loop.py run as documented: refits after
each training step, ending equal to a fresh engine (a fresh server) loaded from the trainer's
final weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
EXAMPLE = EXAMPLES / "vllm_rl_loop.py"


def test_the_vllm_rl_loop_example_runs_and_checks_itself() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2:" in done.stdout and "OK: after 2 refits" in done.stdout, done.stdout[-3000:]


def test_the_vllm_serve_rl_loop_example_refits_a_server_over_http_and_checks_itself() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "vllm_serve_rl_loop.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "server at step-2" in done.stdout and "OK: after 2 refits over HTTP" in done.stdout, done.stdout[-3000:]
