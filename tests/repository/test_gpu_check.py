"""scripts/gpu_check.sh without a GPU: its verdict on JUnit reports that real pytest runs wrote
(passes, failures, collection errors, expected failures, and skips that do or do not declare
the GPUs they need), its choice of test files, and its ``--dry-run``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_report_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


report = _load_report_module()

SUITE = {
    "test_ok.py": """
        import pytest

        def test_runs():
            pass

        @pytest.mark.skipif(True, reason="needs 2 GPUs: one per rank of an NCCL group; found 1")
        def test_two_ranks():
            pass

        @pytest.mark.skipif(True, reason="needs 3 GPUs: a one-to-two broadcast; found 1")
        class TestBroadcastToTwo:
            def test_a(self):
                pass

            def test_b(self):
                pass
        """,
    "test_bad.py": """
        import pytest

        def test_fails():
            assert 1 == 2, "the bytes differ"

        @pytest.mark.skipif(True, reason="device='cuda' needs cupy")
        def test_skips_without_saying_gpus():
            pass

        @pytest.mark.xfail(reason="known to break")
        def test_expected_to_fail():
            assert False
        """,
    "test_broken.py": "import a_module_that_is_not_installed\n",
}


def _run_pytest(folder: Path, files: list[str], junit: Path) -> int:
    """A real pytest run over ``files`` of ``folder``, writing ``junit``."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"]
    command += ["-c", str(folder / "pytest.ini"), f"--junitxml={junit}", "--continue-on-collection-errors"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, timeout=120).returncode


@pytest.fixture(scope="module")
def junit_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """``name -> (report, pytest's exit status)``: "good" (a pass and skips declaring 2 and 3
    GPUs) and "mixed" (every file, the broken one included)."""
    folder = tmp_path_factory.mktemp("suite")
    (folder / "pytest.ini").write_text("[pytest]\n")
    for name, text in SUITE.items():
        (folder / name).write_text(textwrap.dedent(text))
    reports = {}
    for name, files in (("good", ["test_ok.py"]), ("mixed", sorted(SUITE))):
        junit = folder / f"{name}.xml"
        reports[name] = (junit, _run_pytest(folder, files, junit))
    return reports


def _judge(junit_reports: dict[str, tuple[Path, int]], name: str, *, cuda: bool, gpus: int, bench: int | None = 0):
    junit, status = junit_reports[name]
    return report.judge(
        report.read_junit(junit), cuda=cuda, gpus=gpus, pytest_status=status, tests_budget_s=180, bench_status=bench
    )


def _render(verdict: object, *, cuda: bool = True, gpus: int = 1) -> str:
    return str(report.render(verdict, cuda=cuda, gpus=gpus, bench="ran, exit 0", elapsed_s=1, junit="r.xml"))


def test_one_gpu_passes_with_the_tests_that_need_more_gpus_listed_as_not_verified(junit_reports) -> None:
    verdict = _judge(junit_reports, "good", cuda=True, gpus=1)
    assert (verdict.status, verdict.exit_code) == ("PASS", 0)
    assert [c.name for c in verdict.passed] == ["test_ok::test_runs"]
    assert len(verdict.not_verified) == 3 and verdict.bad == []
    text = _render(verdict)
    assert "3 not verified" in text and "1 passed" in text
    assert "2 in test_ok.TestBroadcastToTwo: needs 3 GPUs: a one-to-two broadcast; found 1" in text
    assert "1 in test_ok: needs 2 GPUs: one per rank of an NCCL group; found 1" in text
    assert text.splitlines()[-1] == (
        "result: PASS for what 1 GPU(s) can run; NOT VERIFIED: 3 gpu tests that need 2 or 3 GPUs (listed above)"
    )


def test_a_skip_claiming_more_gpus_than_needed_fails_on_a_machine_that_has_them(junit_reports) -> None:
    verdict = _judge(junit_reports, "good", cuda=True, gpus=2)
    assert (verdict.status, verdict.exit_code) == ("FAIL", 1)
    assert [c.name for c in verdict.bad] == ["test_ok::test_two_ranks"]
    assert len(verdict.not_verified) == 2
    assert "skipped on a CUDA machine without declaring more GPUs than it has" in _render(verdict, gpus=2)


def test_failures_collection_errors_expected_failures_and_other_skips_each_fail_and_are_named(junit_reports) -> None:
    verdict = _judge(junit_reports, "mixed", cuda=True, gpus=1)
    assert (verdict.status, verdict.exit_code) == ("FAIL", 1)
    outcomes = {c.name: c.outcome for c in verdict.bad}
    assert outcomes == {
        "test_bad::test_fails": "failed",
        "test_bad::test_skips_without_saying_gpus": "skipped",
        "test_bad::test_expected_to_fail": "xfailed",
        "test_broken": "error",
    }
    text = _render(verdict)
    assert "FAILED   test_bad::test_fails: AssertionError: the bytes differ" in text
    assert "SKIPPED  test_bad::test_skips_without_saying_gpus: device='cuda' needs cupy" in text
    assert "ERROR    test_broken: collection failure" in text
    result = text.splitlines()[-1]
    assert result.startswith("result: FAIL - ")
    for problem in ("1 gpu test(s) failed", "1 gpu test(s) errored", "1 gpu test(s) xfailed", "1 gpu test(s) skipped"):
        assert problem in result


def test_no_gpu_test_run_fails(junit_reports, tmp_path: Path) -> None:
    empty = tmp_path / "empty.xml"
    empty.write_text('<testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    verdict = report.judge(
        report.read_junit(empty), cuda=True, gpus=1, pytest_status=5, tests_budget_s=180, bench_status=0
    )
    assert verdict.exit_code == 1
    assert "pytest collected no gpu test" in verdict.problems and "no gpu test ran" in verdict.problems
    junit, _ = junit_reports["good"]
    skipped_only = [case for case in report.read_junit(junit) if case.outcome != "passed"]  # all declared skips
    verdict = report.judge(skipped_only, cuda=True, gpus=1, pytest_status=0, tests_budget_s=180, bench_status=0)
    assert verdict.exit_code == 1 and verdict.problems == ["no gpu test ran"]


def test_a_run_past_its_budget_or_without_a_report_fails(junit_reports) -> None:
    junit, _ = junit_reports["good"]
    cases = report.read_junit(junit)
    stopped = report.judge(cases, cuda=True, gpus=1, pytest_status=124, tests_budget_s=180, bench_status=0)
    assert stopped.exit_code == 1 and "ran past their 180s budget" in stopped.problems[0]
    missing = report.judge(None, cuda=True, gpus=1, pytest_status=137, tests_budget_s=180, bench_status=0)
    assert missing.exit_code == 1 and "pytest wrote no JUnit report" in missing.problems


@pytest.mark.parametrize(
    ("bench", "problem"), [(1, "the GPU benchmarks failed (exit status 1)"), (None, "did not run")]
)
def test_the_benchmarks_must_run_and_succeed_on_a_cuda_machine(junit_reports, bench: int | None, problem: str) -> None:
    verdict = _judge(junit_reports, "good", cuda=True, gpus=1, bench=bench)
    assert verdict.exit_code == 1 and any(problem in p for p in verdict.problems), verdict.problems


def test_without_cuda_nothing_is_verified_and_nothing_passes(junit_reports) -> None:
    verdict = _judge(junit_reports, "good", cuda=False, gpus=0, bench=None)
    assert (verdict.status, verdict.exit_code) == ("NOT RUN", 3)
    assert _render(verdict, cuda=False, gpus=0).splitlines()[-1].startswith("result: NOT RUN")
    broken = _judge(junit_reports, "mixed", cuda=False, gpus=0, bench=None)
    assert broken.exit_code == 1  # a failure or a collection error fails even without CUDA


def test_the_verdict_command_prints_and_exits_with_the_verdict(
    junit_reports, capsys: pytest.CaptureFixture[str]
) -> None:
    junit, status = junit_reports["good"]
    argv = ["verdict", "--junit", str(junit), "--cuda", "1", "--gpus", "1", "--pytest-status", str(status)]
    argv += ["--tests-budget", "180", "--bench", "ran, exit 0", "--bench-status", "0", "--elapsed", "12"]
    assert report.main(argv) == 0
    assert "result: PASS for what 1 GPU(s) can run" in capsys.readouterr().out
    assert report.main([*argv[:-4], "--bench-status", "", "--elapsed", "12"]) == 1


def test_only_test_files_that_mark_something_gpu_are_run() -> None:
    files = [str(path) for path in report.gpu_test_files(ROOT)]
    for expected in (
        "plugins/cuda_ipc/tests/test_cuda_ipc_gpu.py",
        "plugins/nccl/tests/test_nccl_gpu.py",
        "plugins/nccl/tests/test_nccl_conformance.py",
        "tests/contract/test_base_merge.py",
    ):
        assert expected in files
    assert "plugins/nccl/tests/test_nccl_transport.py" not in files
    assert "tests/repository/test_gpu_check.py" not in files
    assert not any(f.startswith("plugins/_template/") for f in files)


@pytest.mark.slow
def test_the_dry_run_lists_steps_budgets_and_the_gpu_tests_without_running_them() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "plan: 1 environment 20s, 2 gpu tests 180s, 3 GPU benchmarks 80s, 4 verdict 10s: 290s at most" in out
    assert "-m pytest -m gpu plugins/cuda_ipc/tests/test_cuda_ipc_gpu.py" in out and "-m benchmarks.gpu" in out
    assert "plugins/nccl/tests/test_nccl_conformance.py::TestNcclConformance:" in out
    assert "plugins/nccl/tests/test_nccl_gpu.py::test_a_one_rank_nccl_group_on_a_tcpstore_broadcasts" in out
    assert "test session starts" not in out and "result: DRY RUN" in out
