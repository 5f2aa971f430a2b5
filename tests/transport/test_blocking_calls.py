"""The calls for callers that block: ``send_weights_blocking`` and
``receive_weight_batches_blocking`` (the contract's defaults, and ``BucketedEngine``'s, which
run the refit on the calling thread), and ``owned`` receives on a borrowing engine.

Over the in-process transport (``ckpt_core.testing.in_process``); between processes, over
every plugin, by the conformance kit (``test_blocking_calls_refit_bit_exact``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Generator, Iterator
from typing import Any

import pytest
import torch

import ckpt_core
from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import (
    CheckpointEngineError,
    InvalidArgumentError,
    LifecycleError,
    PeerLostError,
    RemoteRefitError,
    TransferTimeoutError,
)
from ckpt_core.hooks import plugin_manager
from ckpt_core.stats import RefitContext, RefitStats
from ckpt_core.testing.in_process import InProcessEngine, connected_pair

BUCKET = 64 << 10


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Several buckets: whole tensors, one larger than a bucket, odd dtypes, an empty one."""
    generator = torch.Generator().manual_seed(seed)
    out = [(f"layer{i}.weight", torch.randn(64, 90 + i, generator=generator)) for i in range(5)]
    out.append(("big", torch.randn(BUCKET // 2 + 7, generator=generator)))  # spans two buckets
    out.append(("half", torch.randn(7, 9, generator=generator).to(torch.bfloat16)))
    out.append(("mask", torch.rand(33, generator=generator) > 0.5))
    out.append(("empty", torch.empty(0, 4)))
    return out


def assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


class Sender:
    """``send_weights_blocking`` of ``source`` on a thread of its own (no event loop there)."""

    def __init__(self, policy: CheckpointEngine, source: list[tuple[str, torch.Tensor]]) -> None:
        self.error: BaseException | None = None
        self.thread_id: int | None = None
        self._thread = threading.Thread(target=self._run, args=(policy, source), daemon=True)
        self._thread.start()

    def _run(self, policy: CheckpointEngine, source: list[tuple[str, torch.Tensor]]) -> None:
        self.thread_id = threading.get_ident()
        try:
            policy.send_weights_blocking(item for item in source)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc

    def join(self) -> None:
        self._thread.join(30)
        assert not self._thread.is_alive(), "the blocking send did not return"


def receive_copies(batches: Iterator[list[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor copied as it arrives (a borrowed one is valid only until the next batch)."""
    return [(name, tensor.clone()) for batch in batches for name, tensor in batch]


class ThreadsOfHooks:
    """Which thread each refit hook ran on, by role."""

    def __init__(self) -> None:
        self.threads: dict[str, set[int]] = {"policy": set(), "rollout": set()}

    def _saw(self, context: RefitContext) -> None:
        self.threads[context.role].add(threading.get_ident())

    @ckpt_core.hookimpl
    def ckpt_core_refit_started(self, context: RefitContext) -> None:
        self._saw(context)

    @ckpt_core.hookimpl
    def ckpt_core_refit_finished(self, context: RefitContext, stats: RefitStats) -> None:
        self._saw(context)


def test_blocking_refits_are_bit_exact_and_run_on_the_calling_threads() -> None:
    """Three refits each way, blocking on both sides; the hooks fire on the callers' own
    threads (no refit thread: nothing to hand off to)."""
    policy, rollout = connected_pair(BUCKET)
    hooks = ThreadsOfHooks()
    plugin_manager().register(hooks)
    senders: set[int | None] = set()  # each refit's sending thread (idents may or may not be reused)
    try:
        for seed in (1, 2, 3):  # the later refits replay the first's packing
            source = weights(seed)
            sender = Sender(policy, source)
            got = receive_copies(rollout.receive_weight_batches_blocking())
            sender.join()
            senders.add(sender.thread_id)
            assert sender.error is None
            assert_same(got, source)
        assert hooks.threads == {"policy": senders, "rollout": {threading.get_ident()}}
        assert rollout.last_stats is not None and rollout.last_stats.buckets >= 2
    finally:
        plugin_manager().unregister(hooks)
        policy.finalize()
        rollout.finalize()


def test_blocking_and_async_calls_take_turns_on_one_engine_pair() -> None:
    policy, rollout = connected_pair(BUCKET)
    try:
        source = weights(4)
        sender = Sender(policy, source)  # blocking send, async receive

        async def receive() -> list[tuple[str, torch.Tensor]]:
            return [(n, t.clone()) async for batch in rollout.receive_weight_batches() for n, t in batch]

        assert_same(asyncio.run(receive()), source)
        sender.join()
        assert sender.error is None
        source = weights(5)  # async send, blocking receive
        thread = threading.Thread(target=lambda: asyncio.run(policy.send_weights(iter(source))))  # type: ignore[arg-type]
        thread.start()
        assert_same(receive_copies(rollout.receive_weight_batches_blocking()), source)
        thread.join(30)
    finally:
        policy.finalize()
        rollout.finalize()


def test_owned_receive_on_a_borrowing_engine_hands_out_tensors_that_stay() -> None:
    """``owned=True``: no tensor views the transport's buffers, so each keeps its bytes past
    the next batch and the next refit; the refit after it borrows again."""
    policy, rollout = connected_pair(BUCKET, borrow_received_tensors=True)
    try:
        source = weights(6)
        sender = Sender(policy, source)
        kept = [item for batch in rollout.receive_weight_batches_blocking(owned=True) for item in batch]
        sender.join()
        assert not any(rollout.lends(tensor) for _, tensor in kept)
        later = weights(7)
        sender = Sender(policy, later)
        lent = []
        copies = []
        for batch in rollout.receive_weight_batches_blocking():
            lent += [name for name, tensor in batch if rollout.lends(tensor)]
            copies += [(name, tensor.clone()) for name, tensor in batch]
        sender.join()
        assert sender.error is None
        assert_same(kept, source)  # untouched by the refit after it
        assert_same(copies, later)
        assert "layer0.weight" in lent
    finally:
        policy.finalize()
        rollout.finalize()


def test_owned_must_be_a_bool() -> None:
    policy, rollout = connected_pair(BUCKET)
    try:
        for engine in (rollout, AsyncOnly(rollout)):  # BucketedEngine's, and the contract's default
            with pytest.raises(InvalidArgumentError, match="owned must be True or False"):
                next(engine.receive_weight_batches_blocking(owned="yes"))  # type: ignore[arg-type]
    finally:
        policy.finalize()
        rollout.finalize()


def test_closing_a_blocking_receive_early_voids_the_refit_and_fails_the_sender() -> None:
    policy, rollout = connected_pair(BUCKET, timeout_s=5.0)
    try:
        sender = Sender(policy, weights(8))
        batches = rollout.receive_weight_batches_blocking()
        next(batches)
        batches.close()
        sender.join()
        assert sender.error is not None
        with pytest.raises(LifecycleError):
            next(rollout.receive_weight_batches_blocking())
    finally:
        policy.finalize()
        rollout.finalize()


def test_a_failing_weights_generator_fails_a_blocking_send_with_its_own_error() -> None:
    policy, rollout = connected_pair(BUCKET, timeout_s=5.0)

    def failing() -> Generator[tuple[str, torch.Tensor], None, None]:
        yield weights(9)[0]
        raise KeyError("the trainer's shard went missing")

    received: list[BaseException] = []

    def receive() -> None:
        try:
            for _ in rollout.receive_weight_batches_blocking():
                pass
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            received.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyError, match="shard went missing"):
            policy.send_weights_blocking(failing())
        thread.join(30)
        assert len(received) == 1  # the rollout learns the refit is void
        with pytest.raises(LifecycleError):
            policy.send_weights_blocking(item for item in weights(9))
    finally:
        policy.finalize()
        rollout.finalize()


def test_blocking_calls_refuse_a_thread_whose_event_loop_runs() -> None:
    policy, rollout = connected_pair(BUCKET)

    async def inside_a_loop() -> None:
        with pytest.raises(LifecycleError, match="await send_weights"):
            policy.send_weights_blocking(item for item in weights(10))
        with pytest.raises(LifecycleError, match="async for over receive_weight_batches"):
            next(rollout.receive_weight_batches_blocking())

    try:
        asyncio.run(inside_a_loop())
    finally:
        policy.finalize()
        rollout.finalize()


class AsyncOnly(CheckpointEngine):
    """A third party's engine with only the seed's calls: the contract's blocking defaults
    drive them on a loop of their own."""

    def __init__(self, inner: InProcessEngine) -> None:
        self.inner = inner
        self.closed = False

    def prepare(self) -> Any:
        raise NotImplementedError

    def init_policy_process_group(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def init_rollout_process_group(self, **kwargs: Any) -> None:
        raise NotImplementedError

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        await self.inner.send_weights(weights)

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        try:
            async for batch in self.inner.receive_weight_batches():
                yield batch
        finally:
            self.closed = True


def test_the_contracts_blocking_defaults_drive_an_engine_with_only_async_calls() -> None:
    policy, rollout = connected_pair(BUCKET)
    sender, receiver = AsyncOnly(policy), AsyncOnly(rollout)
    try:
        source = weights(11)
        thread = threading.Thread(target=sender.send_weights_blocking, args=(iter(source),))
        thread.start()
        assert_same(receive_copies(receiver.receive_weight_batches_blocking()), source)
        thread.join(30)
        assert receiver.closed and rollout.last_stats is not None
    finally:
        policy.finalize()
        rollout.finalize()


def test_the_contracts_owned_default_clones_what_a_borrowing_engine_lends() -> None:
    policy, rollout = connected_pair(BUCKET, borrow_received_tensors=True)
    sender, receiver = AsyncOnly(policy), AsyncOnly(rollout)
    try:
        source = weights(12)
        thread = threading.Thread(target=sender.send_weights_blocking, args=((item for item in source),))
        thread.start()
        kept = [item for batch in receiver.receive_weight_batches_blocking(owned=True) for item in batch]
        thread.join(30)
        assert not any(rollout.lends(tensor) for _, tensor in kept)
        later = weights(13)
        thread = threading.Thread(target=sender.send_weights_blocking, args=((item for item in later),))
        thread.start()
        assert_same(receive_copies(receiver.receive_weight_batches_blocking()), later)
        thread.join(30)
        assert_same(kept, source)

        async def inside_a_loop() -> None:
            with pytest.raises(LifecycleError, match="event loop"):
                next(receiver.receive_weight_batches_blocking())

        asyncio.run(inside_a_loop())
    finally:
        policy.finalize()
        rollout.finalize()


def test_a_blocking_consumer_that_holds_a_borrowed_batch_too_long_is_timed_out_by_its_sender() -> None:
    """No watchdog on the calling thread: the sender's ``timeout_s`` voids the refit, and the
    consumer's next batch raises a typed error instead of waiting."""
    policy, rollout = connected_pair(BUCKET, borrow_received_tensors=True, timeout_s=0.5)
    try:
        sender = Sender(policy, weights(14))
        batches = rollout.receive_weight_batches_blocking()
        next(batches)
        time.sleep(1.5)
        with pytest.raises(CheckpointEngineError) as raised:
            for _ in batches:
                pass
        sender.join()
        assert isinstance(sender.error, TransferTimeoutError), sender.error
        assert isinstance(raised.value, (RemoteRefitError, PeerLostError)), raised.value
    finally:
        policy.finalize()
        rollout.finalize()
