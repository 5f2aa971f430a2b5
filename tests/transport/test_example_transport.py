"""The worked example (examples/tcp_transport) installs as its own distribution, is found by
its entry-point name, and passes the conformance kit; the template (plugins/_template) is a
valid starting point.

The example is built from a copy of its folder and installed with ``pip install --no-deps
--no-build-isolation --target <tmp>``: the test venv is never changed. Code that must see the
installed entry points runs in subprocesses with that folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

from ckpt_core.transport.engine import BucketedEngine

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tcp_transport"
TEMPLATE = REPO / "plugins" / "_template"
PIP_TIMEOUT_S = 300
KIT_TIMEOUT_S = 600
HOOKS = ("_prepare_transport", "_connect_policy", "_connect_rollout", "_release_transport")


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return env


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the copied source folder, the folder it is installed into)."""
    return _copy_and_install(EXAMPLE, tmp_path_factory.mktemp("tcp_example"), "tcp_transport")


def _copy_and_install(folder: Path, work: Path, name: str) -> tuple[Path, Path]:
    """Copy ``folder`` (a distribution) to ``work/name`` and pip-install the copy into
    ``work/site``, leaving the test venv as it is; returns (the copy, the install folder)."""
    source = work / name
    shutil.copytree(folder, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = work / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-cache-dir", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=work, env={**os.environ, "PIP_NO_INPUT": "1"},
    )  # fmt: skip
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    return source, site


def test_registry_finds_the_installed_example_by_name(installed_example: tuple[Path, Path]) -> None:
    _, site = installed_example
    code = """
import json
from ckpt_core import create_checkpoint_engine, list_backends
import ckpt_core.registry as registry
info = [i for i in list_backends(details=True) if i.name == "tcp_example"]
cls = registry.resolve_backend("tcp_example")
engine = create_checkpoint_engine("tcp_example", bucket_size_bytes=4096, engine_kwargs={"timeout_s": 5})
print(json.dumps({"infos": [i.to_dict() for i in info], "module": __import__(cls.__module__, fromlist=["x"]).__file__,
                  "type": type(engine).__name__}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=_env(site), cwd=site.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(found["infos"]) == 1, found
    info = found["infos"][0]
    assert info["loads"] and info["distribution"] == "ckpt-tcp-example", info
    assert info["target"] == "ckpt_tcp_example.engine:TcpExampleEngine"
    assert info["unavailable_reason"] is None and info["capabilities"]["topologies"] == ["broadcast"]
    assert Path(found["module"]).is_relative_to(site), f"imported from {found['module']}, not the install"
    assert found["type"] == "TcpExampleEngine"


def test_the_example_passes_the_conformance_kit(installed_example: tuple[Path, Path]) -> None:
    source, site = installed_example
    junit = source / "junit.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", f"--junitxml={junit}"],
        capture_output=True, text=True, timeout=KIT_TIMEOUT_S, env=_env(site), cwd=source,
    )  # fmt: skip
    output = f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"the kit failed on the example:\n{output}"
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    not_passed = [c.get("name") for c in cases if len(c)]  # failure, error or skipped children
    assert not not_passed, f"kit tests that did not pass: {not_passed}\n{output}"
    names = {c.get("name", "").split("[")[0] for c in cases}
    for expected in (
        "test_registry_finds_backend_by_name",
        "test_killed_peer_fails_refit_within_timeout",
        "test_every_policy_rank_drains_its_generator_once",
        "test_zero_element_and_scalar_tensors",
    ):
        assert expected in names, f"{expected} did not run: {sorted(names)}"  # fmt: skip


def test_the_template_is_a_complete_skeleton(monkeypatch: pytest.MonkeyPatch) -> None:
    project = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["ckpt_core.backends"]["my_transport"]
    assert target == "ckpt_my_transport.engine:MyTransportEngine"
    monkeypatch.syspath_prepend(str(TEMPLATE))
    module_name, _, class_name = target.partition(":")
    try:
        engine_class = getattr(importlib.import_module(module_name), class_name)
    finally:
        for name in [m for m in sys.modules if m.startswith("ckpt_my_transport")]:
            del sys.modules[name]
    assert issubclass(engine_class, BucketedEngine) and engine_class.backend_name == "my_transport"
    for hook in HOOKS:
        assert hook in vars(engine_class), f"the template does not show {hook}"
    engine = engine_class(bucket_size=1024)
    with pytest.raises(NotImplementedError, match="_prepare_transport"):
        engine.prepare()
    engine.finalize()
    tests = (TEMPLATE / "tests" / "test_my_transport_conformance.py").read_text()
    assert 'backend = "my_transport"' in tests and "TransportConformance" in tests


def test_the_template_runs_as_copied(tmp_path: Path) -> None:
    """Copied out and installed as it is, the template's kit collects every test, passes the
    registry test and fails the others on its TODOs, naming the method to fill in."""
    source, site = _copy_and_install(TEMPLATE, tmp_path, "my_transport")
    junit = source / "junit.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-k", "registry or plain_json", f"--junitxml={junit}"],
        capture_output=True, text=True, timeout=KIT_TIMEOUT_S, env=_env(site), cwd=source,
    )  # fmt: skip
    output = f"{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    outcomes = {c.get("name"): [child.tag for child in c] for c in ET.parse(junit).getroot().iter("testcase")}
    assert outcomes.get("test_registry_finds_backend_by_name") == [], output
    assert outcomes.get("test_prepare_metadata_is_plain_json") == ["failure"], output
    assert "MyTransportEngine._prepare_transport" in output, output
