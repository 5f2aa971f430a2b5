"""``LocalProcessPool`` workers forked from a zygote are the processes ``python -m`` would make:
the environment they were given and nothing else, their working directory and ``PYTHONPATH``
first on ``sys.path`` (a tree put there is the one they run), their share of the cores, and
exit codes reported as ``subprocess`` reports them, at once even while a sibling runs on."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

import ckpt_core
from ckpt_core.errors import InvalidArgumentError
from ckpt_core.orchestration import zygote
from ckpt_core.orchestration.local import LocalProcessPool

PROBE = {"service": "tests.helpers.probe:Probe"}
METHODS = [
    pytest.param("forkserver", marks=pytest.mark.skipif(not zygote.available(), reason="needs Linux")),
    "spawn",
]


def facts(pool: LocalProcessPool, index: int, *names: str) -> dict[str, Any]:
    (result,) = pool.call([(index, "facts", {"names": list(names)})], 60)
    assert result.ok, result.describe()
    return dict(result.value)


def env_with_path(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


def pool_facts(start_method: str, workers: int, env: dict[str, str], names: tuple[str, ...]) -> dict[str, Any]:
    with LocalProcessPool([PROBE] * workers, env=env, start_method=start_method) as pool:
        seen = facts(pool, 0, *names)
    del seen["pid"]
    return seen


@pytest.mark.skipif(not zygote.available(), reason="needs Linux")
def test_a_forked_worker_sees_what_a_fresh_interpreter_does(
    import_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pools in turn, each compared with ``spawn``: the second from another directory,
    with other variables and one worker (a larger share of the cores), so a zygote kept from
    the first must carry none of the first's settings over."""
    cores = os.cpu_count() or 1
    names = ("CKPT_PROBE", "CKPT_PROBE_OTHER", "OMP_NUM_THREADS")
    first = {**os.environ, "PYTHONPATH": str(import_root), "CKPT_PROBE": "first"}
    second = {**os.environ, "PYTHONPATH": str(import_root), "CKPT_PROBE_OTHER": "second"}
    forked = pool_facts("forkserver", 2, first, names)
    assert forked == pool_facts("spawn", 2, first, names)
    assert forked["env"] == {
        "CKPT_PROBE": "first",
        "CKPT_PROBE_OTHER": None,
        "OMP_NUM_THREADS": str(max(1, cores // 2)),
    }
    assert forked["threads"] == max(1, cores // 2) and forked["cwd"] == os.getcwd()

    monkeypatch.chdir(tmp_path)
    forked = pool_facts("forkserver", 1, second, names)
    assert forked == pool_facts("spawn", 1, second, names)
    assert forked["env"] == {"CKPT_PROBE": None, "CKPT_PROBE_OTHER": "second", "OMP_NUM_THREADS": str(cores)}
    assert forked["env_size"] == len(second) + 1  # and OMP_NUM_THREADS: nothing else
    assert forked["threads"] == cores and forked["cwd"] == str(tmp_path) and forked["sys_path"][0] == str(tmp_path)


@pytest.mark.parametrize("start_method", METHODS)
def test_a_tree_first_on_pythonpath_is_the_one_a_worker_runs(
    start_method: str, import_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``benchmarks.against`` relies on: the zygote imported torch, not ckpt_core."""
    monkeypatch.chdir(tmp_path)  # the working directory comes first on sys.path
    other = tmp_path / "other_tree"
    shutil.copytree(Path(ckpt_core.__file__).parent, other / "ckpt_core")
    with LocalProcessPool([PROBE], env=env_with_path(other, import_root), start_method=start_method) as pool:
        assert facts(pool, 0)["ckpt_core"] == str(other / "ckpt_core" / "__init__.py")


@pytest.mark.skipif(not zygote.available(), reason="needs Linux")
def test_exit_codes_and_signals_are_reported_at_once_while_a_sibling_runs_on(import_root: Path) -> None:
    """As ``subprocess`` reports them (what ``spawn`` uses)."""
    with LocalProcessPool([PROBE] * 3, env=env_with_path(import_root), start_method="forkserver") as pool:
        pids = {facts(pool, i)["pid"] for i in range(3)}
        assert len(pids) == 3 and os.getpid() not in pids
        exited, slept = pool.call([(0, "exit", {"code": 3}), (2, "sleep", {"seconds": 30.0})], 10)
        assert not exited.ok and exited.message == "worker 0 exited with status 3", exited.describe()
        pool.kill(1, signal.SIGTERM)
        (killed,) = pool.call([(1, "facts", {"names": []})], 10)
        assert not killed.ok and killed.message == "worker 1 was killed by signal SIGTERM", killed.describe()
        assert not slept.ok and slept.error_type == "TimeoutError"  # stopped past its deadline


@pytest.mark.parametrize("start_method", METHODS)
def test_a_killed_worker_restarts_as_a_fresh_process_while_its_siblings_run_on(
    start_method: str, import_root: Path
) -> None:
    with LocalProcessPool([PROBE] * 2, env=env_with_path(import_root), start_method=start_method) as pool:
        before = [facts(pool, i)["pid"] for i in range(2)]
        pool.kill(1)
        (killed,) = pool.call([(1, "facts", {"names": []})], 10)
        assert not killed.ok and "SIGKILL" in (killed.message or ""), killed.describe()
        pool.restart(1)
        after = [facts(pool, i)["pid"] for i in range(2)]
        assert after[0] == before[0] and after[1] not in before, (before, after)
        pool.restart(0)  # a running one is stopped first
        assert facts(pool, 0)["pid"] not in (*before, *after)


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"start_method must be one of .*got 'fork'"):
        LocalProcessPool([PROBE], start_method="fork")


@pytest.mark.skipif(not zygote.available(), reason="needs Linux")
def test_preloaded_modules_are_imported_before_each_worker_starts(import_root: Path) -> None:
    """A pool's ``preload`` gets a zygote of its own: a pool without it sees none of it."""
    env = env_with_path(import_root)
    modules = ["xml.dom.minidom", "tests.helpers.headers"]
    with LocalProcessPool([PROBE] * 2, env=env, preload=modules) as pool:
        for index in range(2):
            (result,) = pool.call([(index, "imported", {"modules": modules})], 60)
            assert result.ok and result.value == modules, result.describe()
    with LocalProcessPool([PROBE], env=env) as pool:
        (result,) = pool.call([(0, "imported", {"modules": modules})], 60)
        assert result.ok and result.value == [], result.describe()


@pytest.mark.skipif(not zygote.available(), reason="needs Linux")
@pytest.mark.parametrize(
    ("module", "why"),
    [
        ("tests.helpers.starts_a_thread", "started threads (started-at-import); preload less"),
        ("tests.helpers.not_a_module", "No module named 'tests.helpers.not_a_module'"),
    ],
)
def test_a_preload_that_starts_a_thread_or_fails_to_import_is_a_clear_error(
    module: str, why: str, import_root: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A thread started at import would be missing from every fork, its locks held forever."""
    with pytest.raises(RuntimeError, match=rf"zygote \(pid \d+, preloading {module} \(its error is above\)\)"):
        LocalProcessPool([PROBE], env=env_with_path(import_root), preload=[module], start_timeout_s=60)
    assert why in capfd.readouterr().err


@pytest.mark.parametrize("bad", ["transformers", ["not a module"], [""], [3]])
def test_a_preload_that_is_not_a_list_of_module_names_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="preload must be a list of module names"):
        LocalProcessPool([PROBE], preload=bad)
