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
