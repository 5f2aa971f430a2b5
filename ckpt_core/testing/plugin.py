"""pytest plugin of the ckpt-core conformance kit (entry point ``pytest11: ckpt_core_conformance``).

It is loaded by every pytest run in an environment where ckpt-core is installed, and only
defines what a backend author overrides: the fixtures below and the ``ckpt_conformance``
marker. Each fixture reads the same-named attribute of the requesting test class
(``class TestMine(TransportConformance): backend = "mine"``); a fixture of the same name in
a conftest.py, module or class overrides it, as pytest fixtures do. Overrides must be
``scope="class"`` or wider, since the kit's worker pools are shared per class.

With ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set, load it with ``-p ckpt_core.testing.plugin``.
"""

from __future__ import annotations

from typing import Any

import pytest

MARKER = "ckpt_conformance"

DEFAULT_BUCKET_SIZE = 64 << 10


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a test of the ckpt-core transport conformance kit")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the kit's tests, so ``-m ckpt_conformance`` selects them."""
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and any(
            base.__name__ == "TransportConformance" and base.__module__ == "ckpt_core.testing.conformance"
            for base in cls.__mro__
        ):
            item.add_marker(MARKER)


def _setting(request: pytest.FixtureRequest, name: str, default: Any) -> Any:
    return getattr(request.cls, name, default) if request.cls is not None else default


@pytest.fixture(scope="class")
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test, as ``create_checkpoint_engine`` takes it: an entry-point name
    in ``ckpt_core.backends`` (or ``"module:ClassName"``). Abstract: set it."""
    value = _setting(request, "backend", None)
    if not isinstance(value, str) or not value:
        raise pytest.UsageError(
            "the ckpt-core conformance kit needs a backend: set `backend = \"<entry-point name>\"` "
            "on your TransportConformance subclass, or override the `backend` fixture "
            f"(scope='class'); got {value!r}"
        )
    return value


@pytest.fixture(scope="class")
def engine_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Engine options every worker gets (``engine_kwargs``); default none."""
    value = _setting(request, "engine_options", None)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise pytest.UsageError(f"engine_options must be a dict of option name to value, got {value!r}")
    return dict(value)


@pytest.fixture(scope="class")
def bucket_size(request: pytest.FixtureRequest) -> int:
    """Bytes per bucket (``bucket_size_bytes``); default 64 KiB, small so refits span buckets."""
    value = _setting(request, "bucket_size", DEFAULT_BUCKET_SIZE)
    if isinstance(value, bool) or not isinstance(value, int) or value < 64:
        raise pytest.UsageError(f"bucket_size must be an int >= 64 (bytes), got {value!r}")
    return value


@pytest.fixture(scope="class")
def worker_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """Extra environment variables for worker processes (``PYTHONPATH`` entries are
    prepended to the inherited one); default none."""
    value = _setting(request, "worker_env", None)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise pytest.UsageError(f"worker_env must be a dict of str to str, got {value!r}")
    return dict(value)
