"""Entry point of a local worker process: ``python -m ckpt_core.orchestration.worker_main IN_FD OUT_FD``.

The first request must be ``{"method": "__init__", "kwargs": {"service": "module:Class", ...}}``;
it builds the service object. Each later request calls one of its public methods. The process
exits when its input closes (the coordinator is done with it, or went away), after giving the
service's ``finalize()`` a few seconds to release what it holds.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from ckpt_core.orchestration.protocol import decode, encode, error_reply
from ckpt_core.orchestration.workload import load_target


def _reply(out: Any, message: dict[str, Any]) -> None:
    out.write(encode(message))
    out.flush()


def serve(in_fd: int, out_fd: int) -> Any:
    """Answer requests until the input closes; returns the service object (or None)."""
    service: Any = None
    with os.fdopen(in_fd, "rb") as requests, os.fdopen(out_fd, "wb") as out:
        for line in requests:
            try:
                request = decode(line)
                method, kwargs = request["method"], dict(request.get("kwargs") or {})
                if method == "__init__":
                    service = load_target(kwargs.pop("service"))(**kwargs)
                    result = None
                elif service is None or method.startswith("_"):
                    raise RuntimeError(f"cannot call {method!r} before __init__, or a private method")
                else:
                    result = getattr(service, method)(**kwargs)
                _reply(out, {"ok": True, "result": result})
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the coordinator
                _reply(out, error_reply(exc))
    return service


def _finalize_briefly(service: Any, seconds: float = 5.0) -> None:
    """Best-effort release on exit; a peer that is already gone must not keep us alive."""
    finalize = getattr(service, "finalize", None)
    if finalize is None:
        return
    worker = threading.Thread(target=finalize, daemon=True)
    worker.start()
    worker.join(seconds)


if __name__ == "__main__":
    served = serve(int(sys.argv[1]), int(sys.argv[2]))
    _finalize_briefly(served)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destructors of transport objects whose peers exited can block.
    os._exit(0)
