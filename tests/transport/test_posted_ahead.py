"""A gloo_cpu rollout posts the receive of the next refit's first bucket ahead
(``BucketReceiver.expect_refit``, at the end of every refit that ended well), so a policy
that starts first moves its bytes while the rollout is still on its way to its receive. Gloo
moves a message only once its receive is posted: without this, the policy's send of a
one-bucket refit would not return before the rollout called receive. Real processes and groups
(tests/helpers/late_rollout.py)."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from tests.helpers import late_rollout


def _refits(topology: str) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    metadata = [context.Queue(), context.Queue()]
    answers = [context.Queue(), context.Queue()]
    sent = [context.Event() for _ in range(late_rollout.REFITS)]
    done = context.Event()
    results = context.Queue()
    workers = [
        context.Process(target=late_rollout.run, args=(role, topology, metadata[i], answers[i], sent, done, results))
        for i, role in enumerate(("policy", "rollout"))
    ]
    for worker in workers:
        worker.start()
    try:
        gathered = [queue.get(timeout=60) for queue in metadata]
        for queue in answers:
            queue.put(gathered)
        seen = {r["role"]: r for r in (results.get(timeout=4 * late_rollout.WAIT_S) for _ in workers)}
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    errors = [r["error"] for r in seen.values() if "error" in r]
    assert not errors, errors
    return {**seen["rollout"], "send_seconds": seen["policy"]["send_seconds"]}


@pytest.mark.parametrize("topology", ["paired", "fanout"])
def test_a_policy_send_returns_before_a_late_rollout_receives(topology: str) -> None:
    """Refit 0 is received as the rollout calls (nothing is posted at connect); refits 1 and 2
    land in the receive posted when the refit before ended; each arrives whole and in order. (A
    broadcast posts nothing ahead: a posted broadcast would be its group's next collective.)"""
    rollout = _refits(topology)
    sends = f"the policy's sends took {rollout['send_seconds']} s"
    assert rollout["sent_first"] == [None] + [True] * (late_rollout.REFITS - 1), sends
    expected = [
        [(name, sorted(set(t.flatten().tolist()))) for name, t in late_rollout.weights(refit)]
        for refit in range(late_rollout.REFITS)
    ]
    assert rollout["received"] == expected
