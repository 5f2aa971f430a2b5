"""The local launcher's wire protocol: one JSON object per line, in each direction.

Request: ``{"method": str, "kwargs": {...}}``. Reply: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error_type": str, "message": str, "traceback": str}``. Never pickle.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

MAX_LINE_BYTES = 256 << 20


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """Parse one message; ``ValueError`` for anything that is not a JSON object."""
    try:
        message = json.loads(line)
    except RecursionError:
        raise ValueError("protocol message is nested too deeply") from None
    if not isinstance(message, dict):
        raise ValueError(f"protocol message must be a JSON object, got {type(message).__name__}")
    return message


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The reply for a call that raised ``exc`` (call from inside its ``except`` block)."""
    return {
        "ok": False,
        "error_type": type(exc).__name__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
    }
