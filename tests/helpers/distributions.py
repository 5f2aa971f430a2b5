"""Build and pip-install throwaway distributions, so tests can exercise real entry points.

A distribution is written as a ``pyproject.toml`` plus single-file modules into a temp folder
and installed with ``pip install --no-deps --no-build-isolation --target <dir>``: no network,
no change to the test venv. Code that should see the installed entry points runs in a
subprocess with ``<dir>`` on ``PYTHONPATH`` (:func:`run_python`), so the test process's own
``importlib.metadata`` view stays untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PIP_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Distribution:
    """A throwaway distribution: its modules (name -> source) and entry points."""

    name: str
    modules: dict[str, str]
    entry_points: dict[str, dict[str, str]]
    """Group -> {entry-point name -> "module:attribute"}."""
    version: str = "0.0.1"

    def write(self, folder: Path) -> Path:
        """Write the source tree into ``folder / name`` and return that path."""
        root = folder / self.name
        root.mkdir(parents=True)
        lines = [
            "[build-system]",
            'requires = ["setuptools>=61"]',
            'build-backend = "setuptools.build_meta"',
            "",
            "[project]",
            f'name = "{self.name}"',
            f'version = "{self.version}"',
            "",
            "[tool.setuptools]",
            f"py-modules = {json.dumps(sorted(self.modules))}",
        ]
        for group, entries in self.entry_points.items():
            lines += ["", f'[project.entry-points."{group}"]']
            lines += [f'{key} = "{value}"' for key, value in entries.items()]
        (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
        for module, source in self.modules.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
        return root


def install(distributions: list[Distribution], folder: Path) -> Path:
    """Build and install ``distributions`` into ``folder / "site"``; return that directory."""
    sources = [dist.write(folder / "src") for dist in distributions]
    target = folder / "site"
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
        "--no-index", "--disable-pip-version-check", "--no-cache-dir", "--target", str(target),
        *map(str, sources),
    ]  # fmt: skip
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, cwd=folder)
    if result.returncode != 0:
        raise RuntimeError(f"pip install failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return target


def run_python(code: str, *, path: Sequence[Path] = (), env: dict[str, str] | None = None, cwd: Path) -> Any:
    """Run ``code`` in a fresh interpreter with ``path`` prepended to ``PYTHONPATH``.

    The code must print one JSON document as its last stdout line; it is returned decoded.
    A non-zero exit raises ``AssertionError`` carrying the subprocess's stderr.
    """
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=full_env,
        cwd=cwd,
    )
    assert result.returncode == 0, f"subprocess failed ({result.returncode}):\n{result.stderr}"
    lines = result.stdout.strip().splitlines()
    assert lines, f"subprocess printed nothing; stderr:\n{result.stderr}"
    return json.loads(lines[-1])
