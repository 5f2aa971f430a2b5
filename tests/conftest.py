"""Fixtures shared by the core tests in ``tests/``.

``tests/`` has no ``__init__.py``, so pytest puts it on ``sys.path``: test modules import
their helpers as ``helpers.<module>``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def rng() -> torch.Generator:
    """A seeded generator, so random tensors are the same on every run."""
    return torch.Generator().manual_seed(20240611)


@pytest.fixture(scope="session")
def tests_dir() -> Path:
    """This folder, for subprocesses that import ``helpers``."""
    return TESTS_DIR


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path, for Unix sockets (pytest's ``tmp_path``, under
    xdist, can exceed the 107 bytes a socket's path may hold)."""
    path = Path(tempfile.mkdtemp(prefix="ckpt-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
