"""examples/vllm_serve_rl_loop.py runs as documented: it refits a server over HTTP after each
training step and ends equal to a fresh server loaded from the trainer's final weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_serve_rl_loop.py"


def test_the_vllm_serve_rl_loop_example_refits_a_server_over_http_and_checks_itself() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "server at step-2" in done.stdout and "OK: after 2 refits over HTTP" in done.stdout, done.stdout[-3000:]
