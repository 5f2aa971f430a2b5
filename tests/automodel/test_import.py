"""``ckpt_core`` never imports nemo_automodel; using the manager without it fails with the install hint.

One fresh interpreter checks, in order: importing ``ckpt_core`` and ``ckpt_core.automodel``
leaves nemo_automodel unimported; with ``sys.modules['nemo_automodel'] = None`` and then
with an import blocker on ``sys.meta_path`` (nemo_automodel "not installed"), constructing
the manager raises ImportError carrying the install command, while format detection
still works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_COMMAND = "pip install 'ckpt-core[automodel]'"

_SCRIPT = """
import importlib.abc, json, sys

def nemo_modules():
    return sorted(m for m in sys.modules if m.startswith("nemo_automodel"))

import ckpt_core
after_core = nemo_modules()
import ckpt_core.automodel
from ckpt_core.automodel import AutomodelCheckpointManager, detect_checkpoint_format
after_pkg = nemo_modules()

def construct():
    try:
        AutomodelCheckpointManager(dp_mesh=None, tp_mesh=None)
    except ImportError as exc:
        return {"message": str(exc), "cause": type(exc.__cause__).__name__}
    return {"message": None}

sys.modules["nemo_automodel"] = None
set_to_none = construct()
del sys.modules["nemo_automodel"]

class BlockNemo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "nemo_automodel" or name.startswith("nemo_automodel."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, BlockNemo())
blocked = construct()
fmt = detect_checkpoint_format(sys.argv[1])
print(json.dumps({"after_core": after_core, "after_pkg": after_pkg, "set_to_none": set_to_none,
                  "blocked": blocked, "fmt": list(fmt), "still_unimported": nemo_modules()}))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    weights = tmp_path_factory.mktemp("dcp") / "weights"
    (weights / "model").mkdir(parents=True)
    (weights / "model" / ".metadata").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(weights)],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_ckpt_core_and_its_automodel_package_does_not_import_nemo_automodel(result: dict) -> None:
    assert result["after_core"] == [] and result["after_pkg"] == []


def test_manager_with_nemo_automodel_set_to_none_raises_with_install_command(result: dict) -> None:
    assert result["set_to_none"]["message"] is not None
    assert INSTALL_COMMAND in result["set_to_none"]["message"]


def test_manager_without_nemo_automodel_installed_raises_with_install_command(result: dict) -> None:
    assert result["blocked"]["message"] is not None and INSTALL_COMMAND in result["blocked"]["message"]
    assert result["blocked"]["cause"] == "ModuleNotFoundError"


def test_format_detection_works_without_nemo_automodel(result: dict) -> None:
    assert result["fmt"] == ["torch_save", False]
    assert result["still_unimported"] == []
