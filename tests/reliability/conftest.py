"""Fixtures of the reliability suite: the shared worker processes.

The helper modules here (``rel_team``, ``fault_engines``, ...) are imported by package
(``tests.reliability.rel_team``); worker processes get the repository root on ``PYTHONPATH``
(:func:`~tests.reliability.rel_team.worker_env`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.rel_team import Team

TEAM_SIZE = 3  # one policy and two rollout ranks at most in any one test


@pytest.fixture(scope="session")
def team() -> Iterator[Team]:
    """Worker processes shared by every process-level reliability test (see ``rel_team``)."""
    workers = Team(TEAM_SIZE)
    try:
        yield workers
    finally:
        workers.close()
