"""Every kind of bad input in ``rel_bad_inputs.CASES`` (its tables grouped by what they test:
backend names, option values, init arguments and metadata, shared settings, peers, lifecycle
calls, weights, wire bytes) gets a clear, typed error.

One test per row of the tables in docs/reliability.md. Each runs in this process against real
engines (peers on threads where one is needed). A case fails when the error is missing, is not
one of ckpt-core's types (``CheckpointEngineError``) as well as the builtin a caller would
catch, or does not say what was wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability import rel_bad_inputs
from tests.reliability.rel_bad_inputs import CASES, Case, check, run_case


def test_the_table_has_at_least_25_kinds_of_bad_input() -> None:
    kinds = {
        case.id.rsplit("-", 1)[0] if case.id.startswith(("bucket-size", "timeout-", "rank-", "world-size")) else case.id
        for case in CASES
    }
    assert len(kinds) >= 25, sorted(kinds)
    assert len({case.id for case in CASES}) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gets_a_clear_typed_error(case: Case, tmp_path: Path) -> None:
    if case.needs:
        reason = getattr(rel_bad_inputs, case.needs)()
        if reason is not None:
            pytest.skip(f"needs {reason}")
    error = run_case(case, tmp_path)
    problem = check(case, error)
    assert problem is None, problem
