"""Out-of-order lifecycle calls on one engine in this process, each under a deadline.

None of these sequences needs a peer: every one ends in a call the engine must refuse at once
(``LifecycleError`` for engines built on :class:`ckpt_core.transport.engine.BucketedEngine`; any
exception for others), never by waiting for a peer that will not come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from ckpt_core.contract import CheckpointEngine


@dataclasses.dataclass(frozen=True)
class OutOfOrderCase:
    """Steps run in order: all but the last must succeed, the last must raise."""

    name: str
    steps: tuple[str, ...]


OUT_OF_ORDER_CASES: tuple[OutOfOrderCase, ...] = (
    OutOfOrderCase("send_before_prepare", ("send",)),
    OutOfOrderCase("receive_before_prepare", ("receive",)),
    OutOfOrderCase("init_policy_before_prepare", ("init_policy",)),
    OutOfOrderCase("init_rollout_before_prepare", ("init_rollout",)),
    OutOfOrderCase("send_before_init", ("prepare", "send")),
    OutOfOrderCase("receive_before_init", ("prepare", "receive")),
    OutOfOrderCase("prepare_twice", ("prepare", "prepare")),
    OutOfOrderCase("send_after_finalize", ("prepare", "finalize", "send")),
    OutOfOrderCase("receive_after_finalize", ("prepare", "finalize", "receive")),
)


_CALLS = {
    "prepare": "prepare()",
    "init_policy": "init_policy_process_group()",
    "init_rollout": "init_rollout_process_group()",
    "send": "send_weights()",
    "receive": "receive_weight_batches()",
    "finalize": "finalize()",
}


class HungCallError(AssertionError):
    """An engine call neither returned nor raised within its deadline."""


def call_with_deadline(fn: Callable[[], Any], deadline_s: float, what: str) -> BaseException | None:
    """Run ``fn`` on a daemon thread; the exception it raised, or ``None`` if it returned.

    Raises ``HungCallError`` if it is still running after ``deadline_s`` (the thread is left
    behind: a hung engine call cannot be interrupted from outside).
    """
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            fn()
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"ckpt-conformance {what}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive() or "error" not in outcome:
        raise HungCallError(f"{what} neither returned nor raised within {deadline_s:g}s: it must raise, not hang")
    return outcome["error"]


def _one_weight() -> Any:
    yield "conformance.weight", torch.arange(4, dtype=torch.float32)


async def _drain(batches: Any) -> None:
    async for _ in batches:
        pass


def _step(engine: CheckpointEngine, step: str, state: dict[str, Any]) -> None:
    # Before prepare() there is no metadata; placeholders of the right length stand in for it.
    metadata = [state["metadata"]] * 2 if "metadata" in state else [{}, {}]
    sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
    if step == "prepare":
        state["metadata"] = engine.prepare()
    elif step == "init_policy":
        engine.init_policy_process_group(worker_rank=0, **sizes)
    elif step == "init_rollout":
        engine.init_rollout_process_group(rollout_rank=0, **sizes)
    elif step == "send":
        asyncio.run(engine.send_weights(_one_weight()))
    elif step == "receive":
        asyncio.run(_drain(engine.receive_weight_batches()))
    elif step == "finalize":
        engine.finalize()
    else:
        raise ValueError(f"unknown lifecycle step {step!r}")


def run_out_of_order(engine: CheckpointEngine, case: OutOfOrderCase, deadline_s: float) -> BaseException:
    """Run ``case`` on a fresh ``engine``; the exception its last step raised.

    Raises ``AssertionError`` if an in-order step failed, the last step returned normally, or
    any step hung. The engine is finalized afterwards (best effort).
    """
    state: dict[str, Any] = {}
    try:
        for index, step in enumerate(case.steps):
            what = f"{type(engine).__name__}: {_CALLS[step]} (in the sequence {' -> '.join(case.steps)})"
            error = call_with_deadline(lambda: _step(engine, step, state), deadline_s, what)  # noqa: B023
            last = index == len(case.steps) - 1
            if not last and error is not None:
                raise AssertionError(f"{what} is in order, but raised {type(error).__name__}: {error}") from error
        if error is None:
            raise AssertionError(
                f"{type(engine).__name__}: {' -> '.join(case.steps)} succeeded; the last call is out "
                "of order and must raise"
            )
        return error
    finally:
        try:
            call_with_deadline(engine.finalize, deadline_s, f"{type(engine).__name__}.finalize()")
        except HungCallError:
            pass
