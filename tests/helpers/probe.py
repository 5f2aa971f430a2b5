"""A service for ``LocalProcessPool`` tests: reports what its worker process sees."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


class Probe:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def facts(self, names: list[str]) -> dict[str, Any]:
        """The worker's pid, working directory, ``sys.path``, torch's thread count, where
        ``ckpt_core`` was imported from, and the environment variables ``names``."""
        import torch

        import ckpt_core

        return {
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "threads": torch.get_num_threads(),
            "ckpt_core": ckpt_core.__file__,
            "env": {name: os.environ.get(name) for name in names},
            "env_size": len(os.environ),
        }

    def imported(self, modules: list[str]) -> list[str]:
        """Which of ``modules`` this process had imported before it was asked."""
        return [name for name in modules if name in sys.modules]

    def exit(self, code: int) -> None:
        """End the process now, with ``code``."""
        sys.stdout.flush()
        os._exit(code)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
