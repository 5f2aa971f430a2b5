"""An engine's refit thread: kept from one refit to the next, ended when the engine fails or is
finalized (``ckpt_core.transport._refit_thread``). The weights generator runs on the policy's
refit thread, so it tells which thread each refit ran on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_core.testing.in_process import connected_pair, run_refit


class ThreadRecorder:
    """A weights generator factory that notes the thread each refit pulls its weights on."""

    def __init__(self, *, fail: bool = False) -> None:
        self.threads: list[threading.Thread] = []
        self.fail = fail

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.threads.append(threading.current_thread())
        yield "w", torch.arange(64, dtype=torch.float32)
        if self.fail:
            raise RuntimeError("the trainer's gather failed")


def test_an_engine_runs_every_refit_on_one_thread_and_ends_it_at_finalize() -> None:
    policy, rollout = connected_pair(1 << 16)
    weights = ThreadRecorder()
    for _ in range(3):
        outcome = run_refit(policy, rollout, weights)
        assert outcome.send_error is None and outcome.receive_error is None
        assert [name for name, _ in outcome.received] == ["w"]
    (thread,) = set(weights.threads)
    assert thread.name == "ckpt-refit-memory-policy-0" and thread.is_alive()
    policy.finalize()
    rollout.finalize()
    assert not thread.is_alive(), "a finalized engine still holds its refit thread"


def test_a_failed_refit_ends_the_thread_and_the_next_init_starts_another() -> None:
    policy, rollout = connected_pair(1 << 16)
    failing = ThreadRecorder(fail=True)
    outcome = run_refit(policy, rollout, failing)
    assert isinstance(outcome.send_error, RuntimeError)
    (failed_on,) = failing.threads
    assert not failed_on.is_alive(), "a failed engine still holds its refit thread"

    for engine in (policy, rollout):
        engine.finalize()
    metadata = [policy.prepare(), rollout.prepare()]
    sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
    policy.init_policy_process_group(worker_rank=0, **sizes)
    rollout.init_rollout_process_group(rollout_rank=0, **sizes)
    weights = ThreadRecorder()
    outcome = run_refit(policy, rollout, weights)
    assert outcome.send_error is None and outcome.receive_error is None
    (thread,) = weights.threads
    assert thread is not failed_on and thread.is_alive()
    policy.finalize()
    rollout.finalize()
