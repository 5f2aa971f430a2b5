"""Fixtures shared by the core tests in ``tests/``.

``tests/`` is a package (as are its folders), so pytest puts the repository root on
``sys.path`` and test modules import their helpers by package: ``tests.helpers.<module>``,
``tests.reliability.<module>``. Worker processes get the root on ``PYTHONPATH``
(:func:`import_root`) and name test services the same way
(``"tests.reliability.rel_worker:ReliabilityWorker"``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rng() -> torch.Generator:
    """A seeded generator, so random tensors are the same on every run."""
    return torch.Generator().manual_seed(20240611)


@pytest.fixture(scope="session")
def import_root() -> Path:
    """The repository root: what a subprocess puts on ``PYTHONPATH`` to import ``tests.*``."""
    return REPO_ROOT


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path, for Unix sockets (pytest's ``tmp_path``, under
    xdist, can exceed the 107 bytes a socket's path may hold)."""
    path = Path(tempfile.mkdtemp(prefix="ckpt-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- how `make test` schedules the whole suite --------------------------------------------------
# (here because this conftest is the one pytest loads in every process of a run from the root,
# the xdist controller's included)

VLLM_TESTS = "integrations/vllm/tests/"
"""vLLM's tests: the suite's longest, each starting vLLM engines whose OpenMP threads spin
against each other's when two run at once, costing both."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """vLLM's tests first in the run's order (``make test`` hands test scopes to its workers in
    that order, ``--no-loadscope-reorder``): one worker starts on them while the other takes
    the short modules, instead of one worker finishing them alone at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith(VLLM_TESTS))  # stable


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadscope``, vLLM's tests are one scope (one worker runs them in turn,
    never two engines at once); every other module (or class) is a scope of its own."""
    if config.getoption("dist", None) != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return VLLM_TESTS if nodeid.startswith(VLLM_TESTS) else super()._split_scope(nodeid)

    return VllmTestsTogether(config, log)
