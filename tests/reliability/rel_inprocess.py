"""Two real engines in this process: a policy rank and a rollout rank on their own threads.

Rendezvous, group formation and every bucket go through the real transport (TCP sockets for
gloo_cpu, a Unix socket and a memfd for cuda_ipc); only the process boundary is missing. Used
for bad-input and authentication cases, where starting processes would cost more than the
case itself. Every wait is bounded: a side that does not finish in time fails the test as a
hang instead of blocking the suite.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckpt_core.base import CheckpointEngine, create_checkpoint_engine

HANG_S = 60.0


class Outcome:
    """What one side returned, or the exception it raised."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = False

    def get(self) -> Any:
        """The value, re-raising the side's exception."""
        if self.error is not None:
            raise self.error
        return self.value


def concurrently(*functions: Callable[[], Any], hang_s: float = HANG_S) -> list[Outcome]:
    """Run each function on its own thread; one outcome each. A thread still running after
    ``hang_s`` is reported as a hang (``AssertionError``)."""
    outcomes = [Outcome() for _ in functions]

    def run(function: Callable[[], Any], outcome: Outcome) -> None:
        try:
            outcome.value = function()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.error = exc
        outcome.done = True

    threads = [threading.Thread(target=run, args=pair, daemon=True) for pair in zip(functions, outcomes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(hang_s)
    hung = [i for i, o in enumerate(outcomes) if not o.done]
    assert not hung, f"side(s) {hung} did not finish within {hang_s:g}s: a hang"
    return outcomes


async def collect(engine: CheckpointEngine) -> list[tuple[str, torch.Tensor]]:
    received: list[tuple[str, torch.Tensor]] = []
    async for batch in engine.receive_weight_batches():
        received.extend(batch)
    return received


class Pair:
    """Policy rank 0 and rollout rank 0 of one backend, prepared and initialized."""

    def __init__(
        self,
        backend: str = "gloo_cpu",
        *,
        bucket_size: int = 4096,
        engine_kwargs: dict[str, Any] | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        rollout_kwargs: dict[str, Any] | None = None,
        engines: tuple[CheckpointEngine, CheckpointEngine] | None = None,
    ) -> None:
        if engines is None:
            common = {"timeout_s": 20, **(engine_kwargs or {})}
            engines = (
                create_checkpoint_engine(
                    backend, bucket_size_bytes=bucket_size, engine_kwargs={**common, **(policy_kwargs or {})}
                ),
                create_checkpoint_engine(
                    backend, bucket_size_bytes=bucket_size, engine_kwargs={**common, **(rollout_kwargs or {})}
                ),
            )
        self.policy, self.rollout = engines
        self.init_outcomes = self.init()

    @classmethod
    def of(cls, policy: CheckpointEngine, rollout: CheckpointEngine) -> Pair:
        """A pair of engines built by the caller (prepared and initialized here)."""
        return cls(engines=(policy, rollout))

    def init(self) -> list[Outcome]:
        """prepare() and init on both sides; outcomes of the two inits (policy first)."""
        metadata = [self.policy.prepare(), self.rollout.prepare()]
        sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
        return concurrently(
            lambda: self.policy.init_policy_process_group(worker_rank=0, **sizes),
            lambda: self.rollout.init_rollout_process_group(rollout_rank=0, **sizes),
        )

    def refit(self, weights: Callable[[], Iterable[tuple[str, Any]]]) -> tuple[Outcome, Outcome]:
        """One refit; ``weights()`` builds the policy's iterable. Returns (send, receive)."""
        send, receive = concurrently(
            lambda: asyncio.run(self.policy.send_weights(iter(weights()))),  # type: ignore[arg-type]
            lambda: asyncio.run(collect(self.rollout)),
        )
        return send, receive

    def finalize(self) -> None:
        for engine in (self.policy, self.rollout):
            engine.finalize()
