"""Refits that repeat the last one's names, shapes and dtypes replay its packing on the sender
and reuse its checked headers on the receiver; a refit that differs anywhere is still
received whole, in order and bit-exact, and the next one replays the new packing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Iterator

import pytest
import torch

from ckpt_core._internal.send import SLOW_BUCKET_S, SLOW_WEIGHT_S
from ckpt_core._internal.wire import BucketHeader, HeaderMemo, decode_header, encode_header
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import UnsupportedTensorError, WireFormatError
from ckpt_core.testing.in_process import InProcessEngine, connected_pair, run_refit

BUCKET = 16 << 10
Weights = list[tuple[str, torch.Tensor]]


def small_weights(seed: int, count: int = 90) -> Weights:
    """Small tensors of several dtypes and shapes over several buckets (every one replayable)."""
    generator = torch.Generator().manual_seed(seed)
    out: Weights = []
    for i in range(count):
        kind = i % 5
        if kind == 0:
            tensor = torch.randn(8, 16 + i, generator=generator)
        elif kind == 1:
            tensor = torch.randn(3, 5, 7, generator=generator).to(torch.bfloat16)
        elif kind == 2:
            tensor = torch.rand(33, generator=generator) > 0.5
        elif kind == 3:
            tensor = torch.randint(-9, 9, (), generator=generator, dtype=torch.int64)
        else:
            tensor = torch.randn(12, 12, generator=generator)
        out.append((f"layers.{i}.w{kind}", tensor))
    out.insert(40, ("layers.40.empty", torch.empty(0, 3)))
    return out


def refit(policy: InProcessEngine, rollout: InProcessEngine, source: Weights) -> int:
    """One refit of ``source``, checked whole, in order and bit-exact; returns how many
    tensors the sender replayed."""
    outcome = run_refit(policy, rollout, lambda: iter(source))
    assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
    received = outcome.received
    assert [name for name, _ in received] == [name for name, _ in source]
    for (name, got), (_, want) in zip(received, source):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name
    assert policy.last_stats is not None and policy.last_stats.tensors == len(source)
    return policy.last_stats.replayed_tensors


def test_a_repeated_refit_replays_every_tensor_and_stays_bit_exact() -> None:
    policy, rollout = connected_pair(BUCKET)
    assert refit(policy, rollout, small_weights(1)) == 0  # nothing to replay yet
    for seed in (2, 3):  # new values, new tensors, the same names, shapes and dtypes
        assert refit(policy, rollout, small_weights(seed)) == len(small_weights(seed))
    assert policy.last_stats is not None and policy.last_stats.buckets > 3


def _reshaped(w: Weights, k: int) -> Weights:
    return [*w[:k], (w[k][0], torch.randn(2, 3)), *w[k + 1 :]]


def _retyped(w: Weights, k: int) -> Weights:
    return [*w[:k], (w[k][0], w[k][1].to(torch.float64)), *w[k + 1 :]]


def _renamed(w: Weights, k: int) -> Weights:
    return [*w[:k], ("renamed", w[k][1]), *w[k + 1 :]]


def _inserted(w: Weights, k: int) -> Weights:
    return [*w[:k], ("inserted", torch.arange(10)), *w[k:]]


def _removed(w: Weights, k: int) -> Weights:
    return [*w[:k], *w[k + 1 :]]


def _transposed(w: Weights, k: int) -> Weights:  # the same shape, not contiguous
    square = torch.randn(12, 12)
    return [*w[:k], ("square", square.t()), *w[k:]]


def _grown(w: Weights, k: int) -> Weights:  # spans buckets now
    return [*w[:k], (w[k][0], torch.randn(BUCKET // 2)), *w[k + 1 :]]


def _appended(w: Weights, k: int) -> Weights:
    return [*w, ("appended", torch.randn(5, 5))]


def _truncated(w: Weights, k: int) -> Weights:
    return w[:k]


def first_difference(old: Weights, new: Weights) -> int:
    """Index of the first weight of ``new`` whose name, shape, dtype or contiguity differ."""
    for index, ((name, tensor), (old_name, old_tensor)) in enumerate(zip(new, old)):
        same = (name, tensor.shape, tensor.dtype) == (old_name, old_tensor.shape, old_tensor.dtype)
        if not (same and tensor.is_contiguous()):
            return index
    return min(len(old), len(new))


CHANGES: dict[str, Callable[[Weights, int], Weights]] = {
    "a shape": _reshaped,
    "a dtype": _retyped,
    "a name": _renamed,
    "a tensor inserted": _inserted,
    "a tensor removed": _removed,
    "a non-contiguous tensor": _transposed,
    "a tensor grown past a bucket": _grown,
    "a tensor appended": _appended,
    "the stream cut short": _truncated,
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
@pytest.mark.parametrize("k", [0, 37, 89], ids=["first", "middle", "last"])
def test_a_refit_that_differs_is_laid_out_afresh_from_there_and_then_replayed(change: str, k: int) -> None:
    policy, rollout = connected_pair(BUCKET)
    base = small_weights(1)
    changed = CHANGES[change](small_weights(2), k)
    refit(policy, rollout, base)
    # Every tensor before the first that differs is replayed, none from it on.
    assert refit(policy, rollout, changed) == first_difference(base, changed)
    refit(policy, rollout, CHANGES[change](small_weights(3), k))  # the changed packing, again
    refit(policy, rollout, small_weights(4))  # and back


def test_the_changed_packing_is_what_the_next_refit_replays() -> None:
    policy, rollout = connected_pair(BUCKET)
    refit(policy, rollout, small_weights(1))
    changed = _inserted(small_weights(2), 37)
    assert refit(policy, rollout, changed) < len(changed)
    assert refit(policy, rollout, _inserted(small_weights(3), 37)) == len(changed)


def test_a_name_repeated_after_the_replayed_tensors_is_refused() -> None:
    policy, rollout = connected_pair(BUCKET)
    base = small_weights(1)
    refit(policy, rollout, base)
    again = [*small_weights(2), (base[3][0], torch.zeros(4))]
    outcome = run_refit(policy, rollout, lambda: iter(again))
    assert isinstance(outcome.send_error, UnsupportedTensorError)
    assert "appears twice" in str(outcome.send_error)


def _header(nbytes: int, offsets: list[int]) -> BucketHeader:
    chunks = tuple(TensorMeta(f"t{i}", torch.Size([4]), torch.float32, 0, 16, off) for i, off in enumerate(offsets))
    return BucketHeader(refit_index=0, bucket_index=2, payload_nbytes=nbytes, last=False, chunks=chunks)


def test_a_header_repeating_its_chunks_reuses_their_checked_decoding() -> None:
    memo = HeaderMemo()
    first = decode_header(encode_header(_header(64, [0, 16, 32, 48])), bucket_size=BUCKET, memo=memo)
    again = decode_header(encode_header(_header(64, [0, 16, 32, 48])), bucket_size=BUCKET, memo=memo)
    assert again.chunks is first.chunks
    moved = decode_header(encode_header(_header(64, [0, 16, 48, 32])), bucket_size=BUCKET, memo=memo)
    assert moved.chunks is not first.chunks and [m.offset for m in moved.chunks] == [0, 16, 48, 32]


def test_a_repeated_chunk_list_is_still_bounded_by_its_headers_payload() -> None:
    memo = HeaderMemo()
    decode_header(encode_header(_header(64, [0, 16, 32, 48])), bucket_size=BUCKET, memo=memo)
    with pytest.raises(WireFormatError, match="outside the 48-byte payload"):
        decode_header(encode_header(_header(48, [0, 16, 32, 48])), bucket_size=BUCKET, memo=memo)


def copied_on_arrival(policy: InProcessEngine, rollout: InProcessEngine, source: Weights) -> Weights:
    """One refit whose batches are cloned as they arrive (borrowed tensors are valid only
    until the next batch is asked for)."""
    sender = threading.Thread(target=lambda: asyncio.run(policy.send_weights(iter(source))))  # type: ignore[arg-type]
    sender.start()
    copies: Weights = []

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            copies.extend((name, tensor.clone()) for name, tensor in batch)

    asyncio.run(receive())
    sender.join(30)
    return copies


def test_borrowed_buckets_of_many_small_tensors_are_bit_exact_refit_after_refit() -> None:
    """Buckets holding more small tensors than one shared storage run (1 MiB): every run's
    views must show its own bytes of the bucket, in the first refit and in replayed ones."""
    policy, rollout = connected_pair(4 << 20, borrow_received_tensors=True)
    for seed in range(3):
        rows = torch.randn(700, 1024, generator=torch.Generator().manual_seed(seed))
        source = [(f"blocks.{i}.weight", row) for i, row in enumerate(rows)]
        source.insert(300, ("odd", torch.arange(3, dtype=torch.int16)))  # shifts later offsets off 4
        copies = copied_on_arrival(policy, rollout, source)
        assert [n for n, _ in copies] == [n for n, _ in source]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(copies, source)), seed


def test_refits_replay_across_finalize_as_nemo_rl_finalizes_after_every_refit() -> None:
    """With release_after_refit NeMo RL calls finalize() after every refit and prepares and
    inits again before the next: the record and the receiver's decodings outlive that."""
    policy, rollout = connected_pair(BUCKET, release_after_refit=True)
    refit(policy, rollout, small_weights(1))
    for seed in (2, 3):
        policy.finalize()
        rollout.finalize()
        metadata = [policy.prepare(), rollout.prepare()]
        policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
        rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
        assert refit(policy, rollout, small_weights(seed)) == len(small_weights(seed))


def test_a_record_made_under_other_settings_is_not_replayed() -> None:
    """Reconnected to a rollout that borrows, the same policy engine lays the same weights out
    otherwise (no tensor that fits a bucket is split): its record of refits to an owning
    rollout does not apply, and the first refit is laid out afresh, bit-exact."""
    bucket = 256 << 10

    def weights(seed: int) -> Weights:  # the third 100 KiB tensor crosses the first bucket's end
        rows = torch.randn(3, 25 << 10, generator=torch.Generator().manual_seed(seed))
        return [*small_weights(seed), *((f"large.{i}", row) for i, row in enumerate(rows))]

    policy, owning = connected_pair(bucket)
    refit(policy, owning, weights(1))
    policy.finalize()
    borrowing = InProcessEngine(bucket_size=bucket, borrow_received_tensors=True)
    metadata = [policy.prepare(), borrowing.prepare()]
    policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    borrowing.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    for seed, replayed in ((2, 0), (3, len(weights(3)))):
        source = weights(seed)
        copies = copied_on_arrival(policy, borrowing, source)
        assert [n for n, _ in copies] == [n for n, _ in source]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(copies, source))
        assert policy.last_stats is not None and policy.last_stats.replayed_tensors == replayed


def slowly(source: Weights, seconds: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``source``, each weight after ``seconds`` of work on the calling thread."""
    for item in source:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass
        yield item


def paused(source: Weights, seconds: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``source``, each weight after ``seconds`` asleep (a thread the machine paused)."""
    for item in source:
        time.sleep(seconds)
        yield item


def test_weights_that_come_slowly_are_posted_once_they_took_slow_bucket_s() -> None:
    """A generator that works ``SLOW_WEIGHT_S`` or longer per weight (a stage comparing or
    quantizing, a trainer gathering) has its bucket posted once the weights in it took
    ``SLOW_BUCKET_S`` in all, as soon as the last is packed, so the receiver holds them while
    the next are made: one weight per bucket where each took that long, a few where each took
    less. Weights that come at once share buckets, and so do weights that come late only
    because their thread was paused (it did not work)."""
    source = small_weights(7, count=6)
    policy, rollout = connected_pair(1 << 20)
    try:
        outcome = run_refit(policy, rollout, lambda: iter(source))
        assert outcome.receive_error is None and policy.last_stats is not None
        assert policy.last_stats.buckets == 1  # every weight fits one bucket
        outcome = run_refit(policy, rollout, lambda: paused(source, 3 * SLOW_WEIGHT_S))
        assert outcome.receive_error is None and policy.last_stats is not None
        assert policy.last_stats.buckets == 1
        outcome = run_refit(policy, rollout, lambda: slowly(source, SLOW_BUCKET_S))
        assert outcome.send_error is None and outcome.receive_error is None
        assert [name for name, _ in outcome.received] == [name for name, _ in source]
        for (_, got), (_, want) in zip(outcome.received, source):
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        assert policy.last_stats is not None and policy.last_stats.buckets >= len(source)
        assert len(outcome.batches) >= len(source)  # each weight handed on as its bucket came
        # Each a third of SLOW_BUCKET_S: three to a bucket (work measured long by a busy machine
        # closes one sooner, never later).
        outcome = run_refit(policy, rollout, lambda: slowly(source, SLOW_BUCKET_S / 3 + SLOW_WEIGHT_S / 10))
        assert outcome.send_error is None and outcome.receive_error is None
        assert [name for name, _ in outcome.received] == [name for name, _ in source]
        assert policy.last_stats is not None and 2 <= policy.last_stats.buckets <= len(source)
    finally:
        policy.finalize()
        rollout.finalize()


def test_a_bucket_posted_paced_is_handed_on_before_the_next_one_comes() -> None:
    """A receiver whose transport moves payloads only once posted (not shared memory) finishes
    bucket k while bucket k + 1 arrives; a bucket the sender posted paced (its weights come
    slowly) it finishes at once instead, without waiting for the next one's header. The
    generator here holds its next weight until the first is handed on."""
    source = small_weights(11, count=3)
    policy, rollout = connected_pair(1 << 20)
    handed_on: list[str] = []
    waited_s: list[float] = []

    def held_back() -> Generator[tuple[str, torch.Tensor], None, None]:
        for index, item in enumerate(source):
            if index == 0:  # slow work: its bucket is posted once it is packed
                until = time.thread_time() + SLOW_BUCKET_S
                while time.thread_time() < until:
                    pass
            if index == 1:  # until the first weight's bucket was handed on, or 5 s
                start = time.monotonic()
                while not handed_on and time.monotonic() - start < 5.0:
                    time.sleep(0.001)
                waited_s.append(time.monotonic() - start)
            yield item

    errors: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(policy.send_weights(held_back()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            handed_on.extend(name for name, _ in batch)

    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        asyncio.run(receive())
        sender.join(30.0)
        assert not sender.is_alive() and not errors
        assert handed_on == [name for name, _ in source]
        assert waited_s and waited_s[0] < 5.0  # handed on while the next weight was held back
    finally:
        policy.finalize()
        rollout.finalize()
