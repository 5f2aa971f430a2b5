"""The conformance kit catches broken engines, and names what is wrong.

The kit runs, in a pytest subprocess, on the deliberately broken engines of
``tests/transport/broken_engines.py`` (real gloo_cpu engines with one rule broken each); the tests below
assert exactly which kit tests fail and which pass. That the kit passes on correct engines is
shown by the plugins' own conformance tests (plugins/*/tests/test_*_conformance.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

import pytest

from ckpt_core.errors import LifecycleError
from ckpt_core.orchestration.coordinator import RefitReport
from ckpt_core.testing import ConformanceCluster, Shape
from ckpt_core.testing.lifecycle import OUT_OF_ORDER_CASES, HungCallError, call_with_deadline, run_out_of_order

REPO_ROOT = Path(__file__).resolve().parents[2]
KIT_RUN_TIMEOUT_S = 600

BROKEN_SUITE = """
    from ckpt_core.testing import Shape, TransportConformance

    ENV = {{"PYTHONPATH": {import_root!r}}}


    class TestDropsEmptyTensors(TransportConformance):
        backend = "tests.transport.broken_engines:DropsEmptyTensors"
        shapes = (Shape(1, 1),)
        worker_env = ENV


    class TestReordersBatches(TransportConformance):
        backend = "tests.transport.broken_engines:ReordersBatches"
        shapes = (Shape(1, 1),)
        worker_env = ENV


    class TestSkipsDrain(TransportConformance):
        backend = "tests.transport.broken_engines:SkipsDrain"
        shapes = (Shape(2, 1),)
        worker_env = ENV


    class TestNonJsonMetadata(TransportConformance):
        backend = "tests.transport.broken_engines:NonJsonMetadata"


    class TestNoLifecycleChecks(TransportConformance):
        backend = "tests.transport.broken_engines:NoLifecycleChecks"


    class TestHangsOutOfOrder(TransportConformance):
        backend = "tests.transport.broken_engines:HangsOutOfOrder"
        lifecycle_deadline_s = 2.0
"""

# Which kit tests each class runs (pytest -k), and which of them must fail.
SELECTED = {
    "TestDropsEmptyTensors": (
        "test_single_bucket_refit",
        "test_every_dtype",
        "test_zero_element_and_scalar_tensors",
        "test_many_tiny_tensors",
    ),
    "TestReordersBatches": ("test_single_bucket_refit", "test_multi_bucket_refit", "test_tensor_larger_than_bucket"),
    "TestSkipsDrain": ("test_every_policy_rank_drains_its_generator_once",),
    "TestNonJsonMetadata": ("test_prepare_metadata_is_plain_json", "test_finalize_is_idempotent"),
    "TestNoLifecycleChecks": ("test_out_of_order_call_raises",),
    "TestHangsOutOfOrder": ("test_out_of_order_call_raises[send_before_prepare]",),
}


def _run_kit(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Run the kit on the broken engines; ``"Class::test[id]"`` -> (outcome, failure text)."""
    suite = tmp_path / "test_broken_engines_kit.py"
    suite.write_text(textwrap.dedent(BROKEN_SUITE.format(import_root=str(REPO_ROOT))))
    select = " or ".join(
        f"({cls} and {name.replace('[', ' and ').replace(']', '')})"
        for cls, names in SELECTED.items()
        for name in names
    )
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "-k", select,
         f"--junitxml={junit}", "-o", "junit_family=xunit1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=KIT_RUN_TIMEOUT_S,
    )  # fmt: skip
    assert junit.exists(), f"the kit run produced no report:\n{result.stdout}\n{result.stderr}"
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome, text = tag, f"{child.get('message', '')}\n{child.text or ''}"
                break
        outcomes[key] = outcome, text
    return outcomes


@pytest.fixture(scope="module")
def broken_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    return _run_kit(tmp_path_factory.mktemp("kit"))


def _outcome(results: dict[str, tuple[str, str]], key: str) -> tuple[str, str]:
    assert key in results, f"{key} did not run; ran: {sorted(results)}"
    return results[key]


def test_dropped_zero_element_tensors_fail_the_dtype_and_empty_tests(
    broken_results: dict[str, tuple[str, str]],
) -> None:
    for name in ("test_every_dtype[1p1r]", "test_zero_element_and_scalar_tensors[1p1r]"):
        outcome, text = _outcome(broken_results, f"TestDropsEmptyTensors::{name}")
        assert outcome == "failure", (name, outcome, text)
        assert "missing" in text and "empty" in text, text  # the coordinator names the missing tensors
    for name in ("test_single_bucket_refit[1p1r]", "test_many_tiny_tensors[1p1r]"):
        assert _outcome(broken_results, f"TestDropsEmptyTensors::{name}")[0] == "passed", name


def test_reordered_batches_fail_only_multi_batch_refits(broken_results: dict[str, tuple[str, str]]) -> None:
    for name in ("test_multi_bucket_refit[1p1r]", "test_tensor_larger_than_bucket[1p1r]"):
        outcome, text = _outcome(broken_results, f"TestReordersBatches::{name}")
        assert outcome == "failure", (name, outcome, text)
        assert "out of order" in text, text
    # One bucket is one batch: nothing to reorder, so the test passes.
    assert _outcome(broken_results, "TestReordersBatches::test_single_bucket_refit[1p1r]")[0] == "passed"


def test_undrained_generator_fails_the_drain_test(broken_results: dict[str, tuple[str, str]]) -> None:
    outcome, text = _outcome(broken_results, "TestSkipsDrain::test_every_policy_rank_drains_its_generator_once[2p1r]")
    assert outcome == "failure", text
    assert "policy rank 1" in text and "pulling 0 of 12" in text, text


def test_tuple_in_metadata_fails_the_json_test(broken_results: dict[str, tuple[str, str]]) -> None:
    outcome, text = _outcome(broken_results, "TestNonJsonMetadata::test_prepare_metadata_is_plain_json")
    assert outcome == "failure", text
    assert "JSON round trip" in text, text
    assert _outcome(broken_results, "TestNonJsonMetadata::test_finalize_is_idempotent")[0] == "passed"


def test_missing_lifecycle_checks_fail_every_out_of_order_case(broken_results: dict[str, tuple[str, str]]) -> None:
    for case in OUT_OF_ORDER_CASES:
        outcome, text = _outcome(broken_results, f"TestNoLifecycleChecks::test_out_of_order_call_raises[{case.name}]")
        assert outcome == "failure", (case.name, text)


def test_a_hanging_out_of_order_call_fails_instead_of_hanging(broken_results: dict[str, tuple[str, str]]) -> None:
    outcome, text = _outcome(broken_results, "TestHangsOutOfOrder::test_out_of_order_call_raises[send_before_prepare]")
    assert outcome == "failure", text
    assert "must raise, not hang" in text, text


# --- the kit's pieces, in this process ---------------------------------------------------------


def test_out_of_order_cases_raise_lifecycle_error_on_a_real_engine() -> None:
    from ckpt_core import create_checkpoint_engine

    for case in OUT_OF_ORDER_CASES:
        engine = create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs={})
        error = run_out_of_order(engine, case, deadline_s=30.0)
        assert isinstance(error, LifecycleError), (case.name, error)


def test_call_with_deadline_reports_a_hang() -> None:
    import threading

    release = threading.Event()
    with pytest.raises(HungCallError, match="must raise, not hang"):
        call_with_deadline(lambda: release.wait(30), 0.2, "waiting")
    release.set()
    assert isinstance(call_with_deadline(lambda: 1 / 0, 5.0, "dividing"), ZeroDivisionError)
    assert call_with_deadline(lambda: None, 5.0, "nothing") is None


def test_shapes_are_validated_and_named() -> None:
    assert Shape.coerce((2, 1, "paired")) == Shape(2, 1, "paired")
    assert Shape(1, 2).id == "1p2r" and Shape(2, 2, "paired").id == "2p2r-paired"
    assert [Shape(2, 2, "paired").source_rank(r) for r in range(2)] == [0, 1]
    assert [Shape(1, 2, "broadcast").source_rank(r) for r in range(2)] == [0, 0]
    for bad in ((0, 1), (1, True), (1, 1, 3), "1p1r"):
        with pytest.raises(ValueError):
            Shape.coerce(bad)  # type: ignore[arg-type]


def _report(sent: dict[str, str], received: dict[str, str], consumption: Mapping[str, object]) -> RefitReport:
    # The JSON round trip a worker reply takes keeps key order: that is what check_order reads.
    policy = json.loads(json.dumps({"digests": sent, "consumption": consumption}))
    return RefitReport(1, [policy], [json.loads(json.dumps({"digests": received}))])


def test_order_and_consumption_checks_read_the_reports() -> None:
    cluster = ConformanceCluster(backend="gloo_cpu", shape=Shape(1, 1), bucket_size=1024)
    done = {"pulled": 2, "exhausted": True, "expected": 2}
    cluster.check_order(_report({"a": "1", "b": "2"}, {"a": "1", "b": "2"}, done))
    with pytest.raises(AssertionError, match="out of order"):
        cluster.check_order(_report({"a": "1", "b": "2"}, {"b": "2", "a": "1"}, done))
    cluster.check_consumption(_report({}, {}, done))
    with pytest.raises(AssertionError, match="pulling 1 of 2"):
        cluster.check_consumption(_report({}, {}, {"pulled": 1, "exhausted": False, "expected": 2}))


LEAK_PROBE = """
    def test_uses_a_fixture_named_backend(backend):
        pass


    def test_uses_bucket_size(bucket_size):
        pass
"""


def test_the_kit_adds_no_fixture_to_other_tests(tmp_path: Path) -> None:
    """Installing ckpt-core must not give every pytest session fixtures named ``backend``,
    ``bucket_size``, ...: in a project of its own, a test asking for one finds none."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(LEAK_PROBE))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode != 0
    assert run.stdout.count("fixture 'backend' not found") == 1, run.stdout[-3000:]
    assert run.stdout.count("fixture 'bucket_size' not found") == 1, run.stdout[-3000:]
