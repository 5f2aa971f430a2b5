"""An engine's refit thread: kept from one refit to the next, ended when the engine fails or is
finalized (``ckpt_core.transport._refit_thread``). The weights generator runs on the policy's
refit thread, so it tells which thread each refit ran on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt_core.errors import TransferTimeoutError
from ckpt_core.testing.in_process import connected_pair, run_refit
from ckpt_core.transport._refit_thread import RefitCarrier, RefitThread


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


def test_a_step_that_ends_the_refit_frees_its_carrier_before_the_caller_resumes() -> None:
    carrier = RefitCarrier("ckpt-refit-test")
    try:

        async def last_step() -> tuple[int, bool]:
            refit = RefitThread(carrier, idle_s=5.0, stop_s=5.0)
            result = await refit.run(lambda: 7, ends=lambda value: value == 7)
            free = carrier.usable()  # read before stop(): the step itself ended the refit
            await refit.stop()
            return result, free

        assert asyncio.run(last_step()) == (7, True)

        async def failing_step() -> tuple[bool, list[threading.Thread]]:
            refit = RefitThread(carrier, idle_s=5.0, stop_s=5.0)
            with pytest.raises(ValueError, match="the step failed"):
                await refit.run(_fails, ends=lambda _: True)
            busy = carrier.busy  # a step that raised never ends the refit: stop() cleans up
            cleaned_on: list[threading.Thread] = []
            await refit.stop(cleanup=lambda: cleaned_on.append(threading.current_thread()))
            return busy, cleaned_on

        busy, cleaned_on = asyncio.run(failing_step())
        assert busy and cleaned_on == [carrier.thread] and carrier.usable()
    finally:
        carrier.retire()


def _fails() -> None:
    raise ValueError("the step failed")


def _hold_last_batch(rollout: Any, count: int, hold_s: float) -> list[str]:
    """Receive one refit of ``count`` weights, holding the batch that completes it for
    ``hold_s`` before asking for the end."""

    async def receive() -> list[str]:
        names: list[str] = []
        async for batch in rollout.receive_weight_batches():
            names += [name for name, _ in batch]
            if len(names) == count:
                await asyncio.sleep(hold_s)
        return names

    return asyncio.run(receive())


@pytest.mark.parametrize("borrow", [False, True])
def test_a_consumer_may_hold_the_last_batch_past_timeout_s_unless_it_borrows(borrow: bool) -> None:
    """Once the last bucket has arrived, a rollout that owns its tensors finishes the refit on
    its thread with the last batch: nothing is left to wait for, so holding that batch past
    ``timeout_s`` is fine. A borrowing one still releases the lent buffer only when asked for
    the end, so it voids the refit as after any other batch."""
    count = 6
    policy, rollout = connected_pair(1 << 12, timeout_s=0.5, borrow_received_tensors=borrow)
    weights = [(f"w{i}", torch.full((256,), float(i))) for i in range(count)]
    sent: list[BaseException | None] = []

    def send() -> None:
        try:
            asyncio.run(policy.send_weights(iter(weights)))  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - checked below
            sent.append(exc)
        else:
            sent.append(None)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        if borrow:
            with pytest.raises(TransferTimeoutError, match="not asked for within timeout_s"):
                _hold_last_batch(rollout, count, hold_s=1.5)
            sender.join(10.0)
            assert isinstance(sent[0], TransferTimeoutError)  # its last slot was never released
        else:
            assert _hold_last_batch(rollout, count, hold_s=1.5) == [name for name, _ in weights]
            sender.join(10.0)
            assert sent == [None]
            assert rollout.last_stats is not None and rollout.last_stats.buckets > 1
            outcome = run_refit(policy, rollout, lambda: iter(weights))  # the engines go on
            assert outcome.send_error is None and outcome.receive_error is None
            assert [name for name, _ in outcome.received] == [name for name, _ in weights]
    finally:
        sender.join(10.0)
        policy.finalize()
        rollout.finalize()


def test_the_refit_thread_holds_no_batch_once_the_caller_has_it() -> None:
    """The last step's batch is handed over and ends the refit on the thread, which then
    returns from the step while the caller may already run: a batch the caller drops is freed
    at once, refit after refit (its memory back in the host pool). Before the hand-over went
    through a box the caller empties, the thread's frame still held a tenth to a third of them."""
    from ckpt_core._internal.host_alloc import HUGE_PAGE_THRESHOLD, pooled_bytes, release_host_pool

    policy, rollout = connected_pair(HUGE_PAGE_THRESHOLD, direct_chunks=True)
    weights = [("big", torch.randn(HUGE_PAGE_THRESHOLD // 2))]
    held = 0
    try:
        for _ in range(100):
            release_host_pool()
            outcome = run_refit(policy, rollout, lambda: iter(weights))
            assert outcome.receive_error is None and outcome.send_error is None
            del outcome
            held += pooled_bytes() == 0
    finally:
        policy.finalize()
        rollout.finalize()
        release_host_pool()
    assert held == 0, f"the received tensor outlived the caller's last reference in {held} of 100 refits"
