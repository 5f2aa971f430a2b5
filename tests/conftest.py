"""Fixtures shared by the core tests in ``tests/``.

``tests/`` is a package (as are its folders), so pytest puts the repository root on
``sys.path`` and test modules import their helpers by package: ``tests.helpers.<module>``,
``tests.reliability.<module>``. Worker processes get the root on ``PYTHONPATH``
(:func:`import_root`) and name test services the same way
(``"tests.reliability.rel_worker:ReliabilityWorker"``).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Exempt what collection imported (torch, vLLM, transformers: ~670,000 objects) from the
    garbage collector, in each test process of the suite. Engines call ``gc.collect()`` when
    they let go of a transport, and each call walked all of it: 0.6 s in a process that had
    imported vLLM, twice per refit pair (the bad-input table took 89 s instead of 17). What
    the tests themselves create is collected as before."""
    gc.freeze()


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
