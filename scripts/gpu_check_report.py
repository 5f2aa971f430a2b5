"""The logic of scripts/gpu_check.sh that is worth testing without a GPU: which test files hold
gpu tests, and the verdict on a run from pytest's JUnit report.

    python scripts/gpu_check_report.py files ROOT
    python scripts/gpu_check_report.py verdict --junit PATH --cuda 0|1 --gpus N --pytest-status N \\
        --tests-budget S --bench "TEXT" --bench-status N --elapsed S

The rule: a gpu test that does not run on a CUDA machine verified nothing, so it fails the
check, unless its skip reason declares that it needs more GPUs than this machine has
(``"needs N GPUs: ..."``); those are listed as NOT VERIFIED, never counted as passed. No gpu
test at all, a failure, an error (collection included), an expected failure, a step past its
budget or a failed benchmark fails the check too. Without CUDA nothing is verified: the
verdict is NOT RUN (exit 3), unless something failed outright.

Standard library only: it runs with whatever interpreter the script found.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NEEDS_GPUS = re.compile(r"^needs (\d+) GPUs?\b")
"""A skip reason that declares a GPU count; any other skip of a gpu test on a CUDA machine fails."""
GPU_MARK = re.compile(r"\bmark\.gpu\b")
TEST_FOLDERS = ("tests", "plugins", "integrations")
EXIT_PASS, EXIT_FAIL, EXIT_NOT_RUN = 0, 1, 3
TIMED_OUT = (124, 137)  # timeout(1): the signal was sent, then KILL was


def gpu_test_files(root: Path) -> list[Path]:
    """Test modules (``test_*.py`` under tests/, plugins/ and integrations/, not plugins/_template)
    that mark something ``gpu``, relative to ``root``, sorted. Only these are collected: modules
    without gpu tests, and their optional imports, stay out of the run."""
    found = []
    for folder in TEST_FOLDERS:
        for path in sorted((root / folder).rglob("test_*.py")):
            relative = path.relative_to(root)
            if relative.parts[:2] == ("plugins", "_template") or ".venv" in relative.parts:
                continue
            if GPU_MARK.search(path.read_text(encoding="utf-8", errors="replace")):
                found.append(relative)
    return sorted(found)


@dataclass(frozen=True)
class Case:
    """One test of the report: ``outcome`` is passed, failed, error, skipped or xfailed."""

    name: str
    outcome: str
    message: str = ""


def read_junit(path: Path) -> list[Case]:
    """Every test case of a pytest JUnit XML report; a malformed report raises
    ``xml.etree.ElementTree.ParseError``."""
    cases = []
    for element in ET.parse(path).getroot().iter("testcase"):
        name = "::".join(filter(None, [element.get("classname"), element.get("name")]))
        failure, error, skipped = (element.find(tag) for tag in ("failure", "error", "skipped"))
        if failure is not None:
            cases.append(Case(name, "failed", failure.get("message") or ""))
        elif error is not None:
            cases.append(Case(name, "error", error.get("message") or (error.text or "")))
        elif skipped is not None:
            outcome = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
            cases.append(Case(name, outcome, skipped.get("message") or ""))
        else:
            cases.append(Case(name, "passed"))
    return cases


@dataclass
class Verdict:
    status: str  # PASS, FAIL or NOT RUN
    exit_code: int
    passed: list[Case] = field(default_factory=list)
    not_verified: list[Case] = field(default_factory=list)
    bad: list[Case] = field(default_factory=list)  # failed, errors, unexpected skips, xfails
    problems: list[str] = field(default_factory=list)


def needed_gpus(case: Case) -> int | None:
    """The GPU count a skipped case declares it needs, or ``None``."""
    match = NEEDS_GPUS.match(case.message.strip())
    return int(match.group(1)) if match else None


def judge(
    cases: list[Case] | None,
    *,
    cuda: bool,
    gpus: int,
    pytest_status: int,
    tests_budget_s: float,
    bench_status: int | None,
) -> Verdict:
    """The verdict on one run. ``cases`` is ``None`` when pytest wrote no report;
    ``bench_status`` is ``None`` when the benchmarks did not run."""
    verdict = Verdict("PASS", EXIT_PASS)
    problems = verdict.problems
    if pytest_status in TIMED_OUT:
        problems.append(
            f"the gpu tests ran past their {tests_budget_s:g}s budget and were stopped; what finished is listed"
        )
    elif pytest_status == 5:
        problems.append("pytest collected no gpu test")
    elif pytest_status not in (0, 1):
        problems.append(f"pytest ended with exit status {pytest_status} (interrupted, internal or usage error)")
    if cases is None:
        problems.append("pytest wrote no JUnit report")
        cases = []
    for case in cases:
        if case.outcome == "passed":
            verdict.passed.append(case)
        elif case.outcome == "skipped" and cuda:
            needs = needed_gpus(case)
            if needs is not None and needs > gpus:
                verdict.not_verified.append(case)
            else:
                verdict.bad.append(case)
        elif case.outcome == "skipped":
            verdict.not_verified.append(case)
        else:
            verdict.bad.append(case)
    counts = {outcome: sum(c.outcome == outcome for c in verdict.bad) for outcome in ("failed", "error", "xfailed")}
    skips = sum(c.outcome == "skipped" for c in verdict.bad)
    for outcome, count in counts.items():
        if count:
            problems.append(f"{count} gpu test(s) {outcome if outcome != 'error' else 'errored'}")
    if skips:
        problems.append(f"{skips} gpu test(s) skipped on a CUDA machine without declaring more GPUs than it has")
    if cuda and not verdict.passed:
        problems.append("no gpu test ran")
    if cuda and bench_status is None:
        problems.append("the GPU benchmarks did not run")
    elif bench_status:
        problems.append(
            f"the GPU benchmarks failed (exit status {bench_status}"
            + (", past their budget)" if bench_status in TIMED_OUT else ")")
        )
    if problems:
        verdict.status, verdict.exit_code = "FAIL", EXIT_FAIL
    elif not cuda:
        verdict.status, verdict.exit_code = "NOT RUN", EXIT_NOT_RUN
    return verdict


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def render(verdict: Verdict, *, cuda: bool, gpus: int, bench: str, elapsed_s: float, junit: str) -> str:
    """The summary the script prints: every case that failed the check, the not-verified ones
    grouped by class and reason, the benchmarks, the time and the result line."""
    lines = ["", "==================== gpu_check verdict ===================="]
    machine = f"{gpus} CUDA GPU(s)" if cuda else "no CUDA device"
    lines.append(
        f"machine: {machine}; gpu tests: {len(verdict.passed)} passed, {len(verdict.bad)} failing the check, "
        f"{len(verdict.not_verified)} not verified"
    )
    labels = {"failed": "FAILED", "error": "ERROR", "skipped": "SKIPPED", "xfailed": "XFAILED"}
    for case in verdict.bad:
        lines.append(f"  {labels[case.outcome]:8} {case.name}: {_first_line(case.message)}")
    groups: dict[tuple[str, str], list[Case]] = {}
    for case in verdict.not_verified:
        module_or_class = case.name.rsplit("::", 1)[0]
        groups.setdefault((module_or_class, _first_line(case.message)), []).append(case)
    if verdict.not_verified:
        heading = "NOT VERIFIED on this machine (never counted as passed):" if cuda else "NOT VERIFIED (no CUDA):"
        lines.append(f"  {heading}")
        for (where, reason), members in groups.items():
            lines.append(f"    {len(members):3} in {where}: {reason}")
    lines.append(f"benchmarks: {bench}")
    lines.append(f"time: {elapsed_s:.0f}s; JUnit report: {junit}")
    if verdict.status == "FAIL":
        lines.append("result: FAIL - " + "; ".join(verdict.problems))
    elif verdict.status == "NOT RUN":
        lines.append("result: NOT RUN - no CUDA device is visible: nothing was verified")
    elif verdict.not_verified:
        needs = sorted({needed_gpus(c) or 0 for c in verdict.not_verified})
        lines.append(
            f"result: PASS for what {gpus} GPU(s) can run; NOT VERIFIED: {len(verdict.not_verified)} gpu tests "
            f"that need {' or '.join(map(str, needs))} GPUs (listed above)"
        )
    else:
        lines.append("result: PASS - every gpu test ran and passed")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check_report.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    files = commands.add_parser("files", help="print the test files that hold gpu tests, one a line")
    files.add_argument("root", type=Path)
    verdict = commands.add_parser("verdict", help="judge a run; the exit status is the script's")
    verdict.add_argument("--junit", required=True)
    verdict.add_argument("--cuda", type=int, choices=(0, 1), required=True)
    verdict.add_argument("--gpus", type=int, required=True)
    verdict.add_argument("--pytest-status", type=int, required=True)
    verdict.add_argument("--tests-budget", type=float, required=True)
    verdict.add_argument("--bench", required=True, help="what happened to the benchmarks, in words")
    verdict.add_argument("--bench-status", default="", help="their exit status; empty if they did not run")
    verdict.add_argument("--elapsed", type=float, default=0.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "files":
        for path in gpu_test_files(args.root):
            print(path)
        return 0
    junit = Path(args.junit)
    try:
        cases = read_junit(junit) if junit.is_file() else None
    except ET.ParseError as exc:
        print(f"[gpu_check] the JUnit report {junit} is malformed: {exc}")
        cases = None
    verdict = judge(
        cases,
        cuda=bool(args.cuda),
        gpus=args.gpus,
        pytest_status=args.pytest_status,
        tests_budget_s=args.tests_budget,
        bench_status=int(args.bench_status) if args.bench_status != "" else None,
    )
    print(
        render(
            verdict, cuda=bool(args.cuda), gpus=args.gpus, bench=args.bench, elapsed_s=args.elapsed, junit=args.junit
        )
    )
    return verdict.exit_code


if __name__ == "__main__":
    sys.exit(main())
