"""Shared pieces of the process-level fault tests: striking a worker mid-refit, reading
trails, recomputing what a policy sent."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ckpt_core.orchestration.coordinator import CallResult, RefitFailedError
from ckpt_core.orchestration.workload import digests
from ckpt_core.testing.weights import slow
from tests.reliability.rel_team import Team

MARKER_WAIT_S = 120.0


class Striker:
    """Sends ``sig`` to a team slot as soon as ``marker`` exists (the policy's weights
    generator creates it once the refit is in flight); records when it struck."""

    def __init__(self, team: Team, slot: int, marker: Path, sig: int = signal.SIGKILL) -> None:
        self.team, self.slot, self.marker, self.sig = team, slot, marker, sig
        self.struck_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + MARKER_WAIT_S
        while not self.marker.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        self.team.kill(self.slot, self.sig)
        self.struck_at = time.monotonic()

    def seconds_since_strike(self) -> float:
        """Seconds from the strike to now; fails the test if it never struck."""
        now = time.monotonic()
        self._thread.join(MARKER_WAIT_S)
        assert self.struck_at is not None, f"the refit never got in flight ({self.marker} was not created)"
        return now - self.struck_at


def failures_by_worker(error: RefitFailedError) -> dict[str, CallResult]:
    return {f.worker: f for f in error.failures}


def slow_source(params: dict[str, Any], refit_index: int) -> dict[str, str]:
    """Digests of what ``rel_weights:marked`` / ``slow`` yields for ``refit_index``."""
    return digests(slow(params, refit_index=refit_index, rank=0))


def read_trail(path: Path) -> dict[str, str]:
    """name -> digest of every tensor a rollout was handed (see ``rel_worker``)."""
    if not path.exists():
        return {}
    trail = {}
    for line in path.read_text().splitlines():
        name, digest = line.rsplit(" ", 1)
        assert name not in trail, f"{name} was handed out twice"
        trail[name] = digest
    return trail


def clear(path: Path) -> None:
    if path.exists():
        os.truncate(path, 0)
