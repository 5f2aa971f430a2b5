"""Round three of the bad-input table (issue #31): inputs that loaded wrong weights, aborted the
process, waited without a deadline or raised an untyped error before.

Each case runs as every row of :mod:`rel_bad_inputs` does (``test_rel_bad_inputs.py`` walks all
three lists) and must raise one of ckpt-core's typed errors. Cases with a time bound assert it
themselves: a rendezvous that cannot happen must fail within ``timeout_s`` plus a margin, and its
message must tell the time it spent.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ckpt_core.errors import (
    CheckpointEngineError,
    EngineOptionError,
    IntegrityError,
    PeerLostError,
    RemoteRefitError,
    UnsupportedTensorError,
    WireFormatError,
)
from tests.reliability.rel_bad_inputs import Case, engine, init_policy, init_rollout
from tests.reliability.rel_hostile_inputs import both_refuse
from tests.reliability.rel_inprocess import Pair, concurrently

RENDEZVOUS_TIMEOUT_S = 3.0
MARGIN_S = 2.5
"""What a bounded rendezvous may take beyond its ``timeout_s`` on a busy two-core machine."""

WEIGHT_ELEMENTS = 75_000
"""300 KB float32 weights: sent direct (chunks of a quarter bucket or more) from 1 MiB buckets,
three to a bucket, so a bucket is posted only after the weight that follows it was yielded."""


def within(seconds: float, limit: float, what: str) -> None:
    assert seconds < limit, f"{what} took {seconds:.1f}s, over its bound of {limit:.1f}s: a wait without deadline"


# --- settings only one side applies ---------------------------------------------------------------


def metadata_entry(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[Path], Any]:
    """The rollout's metadata entry altered by ``change`` before a policy's init sees it."""

    def run(_: Path) -> Any:
        policy, rollout = engine(), engine()
        try:
            entries = [policy.prepare(), rollout.prepare()]
            entries[1] = change(entries[1])
            init_policy(policy, entries, train=1, rollout=1)
        finally:
            policy.finalize()
            rollout.finalize()

    return run


def nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {}
    top = node
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    return top


# --- a rendezvous nobody serves ------------------------------------------------------------------


def rollout_alone(policy_entry: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Callable[[Path], Any]:
    """A rollout's init while policy rank 0 was prepared but never serves its rendezvous (it
    never calls init, or its init failed before serving, or it is stopped); ``policy_entry``
    forges policy rank 0's metadata entry instead. Must fail within ``timeout_s`` plus a
    margin, saying how long it tried."""

    def run(_: Path) -> Any:
        options: dict[str, Any] = {"timeout_s": RENDEZVOUS_TIMEOUT_S}
        policy, rollout = engine(**options), engine(**options)
        try:
            entries = [policy.prepare(), rollout.prepare()]
            if policy_entry is not None:
                entries[0] = policy_entry(entries[0])
            start = time.monotonic()
            (outcome,) = concurrently(lambda: init_rollout(rollout, entries, train=1, rollout=1), hang_s=30)
            within(time.monotonic() - start, RENDEZVOUS_TIMEOUT_S + MARGIN_S, "the rollout's init")
            raise outcome.error or AssertionError("the rollout's init succeeded without its policy")
        finally:
            policy.finalize()
            rollout.finalize()

    return run


def member_never_comes() -> Callable[[Path], Any]:
    """1 policy -> 2 rollouts; rollout rank 1 never calls init. Policy rank 0 gives up at its
    timeout, and rollout rank 0, which came, is told so: a lost peer, not a bad option."""

    def run(_: Path) -> Any:
        options: dict[str, Any] = {"timeout_s": RENDEZVOUS_TIMEOUT_S}
        engines = [engine(**options) for _ in range(3)]
        try:
            entries = [e.prepare() for e in engines]
            sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 2, "metadata": entries}
            policy, rollout0 = concurrently(
                lambda: engines[0].init_policy_process_group(worker_rank=0, **sizes),
                lambda: engines[1].init_rollout_process_group(rollout_rank=0, **sizes),
                hang_s=30,
            )
            assert isinstance(policy.error, PeerLostError), f"policy rank 0 got {policy.error!r}"
            raise rollout0.error or AssertionError("rollout rank 0 joined a rendezvous missing a member")
        finally:
            for e in engines:
                e.finalize()

    return run


# --- weights generators that free or reuse what they yielded -------------------------------------


def frees_previous(n: int, elements: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A fresh weight each time, freeing the one before (as leaving a per-module FSDP
    ``summon_full_params`` does) once the next is asked for."""
    previous = None
    for i in range(n):
        weight = torch.full((elements,), float(i))
        if previous is not None:
            previous.untyped_storage().resize_(0)
        yield f"w{i}", weight
        previous = weight


def refills_one_buffer(
    n: int, elements: int, first: int = 0, fresh_after: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One buffer, refilled for each weight: yields the same memory every time (from weight
    ``fresh_after`` on, a fresh tensor each time instead)."""
    buffer = torch.empty(elements)
    for i in range(n):
        if fresh_after is not None and i >= fresh_after:
            yield f"w{i}", torch.full((elements,), float(first + i))
            continue
        buffer.fill_(float(first + i))
        yield f"w{i}", buffer


def refit_outcome(
    weights: Callable[[int], Iterator[tuple[str, torch.Tensor]]], refits: int = 1, **options: Any
) -> Callable[[Path], Any]:
    """``refits`` refits on a gloo_cpu pair with 1 MiB buckets (``weights(k)`` yields refit
    ``k``'s weights); the last one must fail on both sides: the policy's error is the case's
    unless the rollout's is a corruption it caught."""

    def run(_: Path) -> Any:
        pair = Pair("gloo_cpu", bucket_size=1 << 20, engine_kwargs=options)
        try:
            for outcome in pair.init_outcomes:
                outcome.get()
            for k in range(refits):
                sent, received = pair.refit(functools.partial(weights, k))
                if k < refits - 1:
                    sent.get()
                    received.get()
            assert received.error is not None, "the rollout received the refit as if nothing were wrong"
            if isinstance(received.error, IntegrityError):
                raise received.error
            assert isinstance(received.error, RemoteRefitError), f"the rollout got {received.error!r}"
            raise sent.error or AssertionError("the policy sent the refit as if nothing were wrong")
        finally:
            pair.finalize()

    return run


def fresh_then_refilled(refit_index: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh tensors in the first refit, one refilled buffer after: a generator whose memory
    use changed between two refits of one layout."""
    if refit_index == 0:
        return ((f"w{i}", torch.full((64,), float(i))) for i in range(40))
    return refills_one_buffer(40, 64, first=100)


ROUND3_CASES: list[Case] = [
    Case(
        "shard-expert-weights-rollout-only",
        "`shard_expert_weights=True` on the rollout only (it expects its shards, the policy would send whole weights)",
        both_refuse("gloo_cpu", {}, {"shard_expert_weights": True}),
        (EngineOptionError,),
        r"policy rank 0 uses shard_expert_weights False, this worker True",
    ),
    Case(
        "metadata-not-json",
        "a metadata entry holding a value that is not JSON data (`engine_id` of bytes)",
        metadata_entry(lambda entry: {**entry, "engine_id": entry["engine_id"].encode()}),
        (WireFormatError,),
        r"metadata\[1\] is not plain JSON data: \['engine_id'\] is a bytes",
    ),
    Case(
        "metadata-nested-deep",
        "a metadata entry nested ~990 levels deep (a forged layout `json.loads` accepts)",
        metadata_entry(lambda entry: {**entry, "weight_layout": nested(990)}),
        (WireFormatError,),
        r"metadata\[1\] is not plain JSON data: .* is nested deeper than 32 levels",
    ),
    Case(
        "rendezvous-never-served",
        "policy rank 0 prepared but never serving its rendezvous (no init, a failed init, stopped)",
        rollout_alone(),
        (PeerLostError,),
        r"cannot reach policy rank 0's rendezvous at .*: gave up after 3\.\ds \(timeout_s=3;",
    ),
    Case(
        "rendezvous-port-closed",
        "policy rank 0's metadata naming a port nobody listens on (port 1)",
        rollout_alone(lambda entry: {**entry, "port": 1}),
        (PeerLostError,),
        r"rendezvous at 127\.0\.0\.1:1: gave up after 3\.\ds",
    ),
    Case(
        "rendezvous-host-huge",
        "policy rank 0's metadata naming a 20 MB host",
        rollout_alone(lambda entry: {**entry, "host": "h" * (20 << 20)}),
        (WireFormatError,),
        r"policy rank 0's metadata has no valid host: 'hhh.*\(20971520 characters\)",
    ),
    Case(
        "rendezvous-member-missing",
        "a rollout rank that never calls init (the others are told policy rank 0 gave up)",
        member_never_comes(),
        (PeerLostError,),
        # Both wait timeout_s: the rollout hears policy rank 0 gave up, or gives up itself first.
        r"rollout rank 0 (cannot join: policy rank 0 gave up waiting for the other workers|failed after \d+\.\ds)",
    ),
    Case(
        "weight-freed-after-yield",
        "a generator freeing each weight once the next is asked for, weights sent direct (gloo_cpu)",
        refit_outcome(lambda k: frees_previous(12, WEIGHT_ELEMENTS)),
        (UnsupportedTensorError,),
        r"weight 'w0' was freed \(its storage now holds 0 bytes\) after it was yielded and before the sender read it",
    ),
    Case(
        "weight-refilled-after-yield-checksum",
        "a generator refilling one buffer, weights sent direct, `checksum=True` (digests are of the bytes as yielded)",
        # The first bucket's three weights share the buffer; later weights are fresh, so its
        # bytes change only before that bucket is posted, never while it is on the wire.
        refit_outcome(lambda k: refills_one_buffer(12, WEIGHT_ELEMENTS, fresh_after=3), checksum=True),
        (IntegrityError,),
        r"bucket 0 of refit 0 is corrupt",
    ),
    Case(
        "weights-alias-in-replay",
        "a generator whose tensors share one buffer in a repeated refit, not in the first",
        refit_outcome(fresh_then_refilled, refits=2),
        (UnsupportedTensorError,),
        r"weights 'w\d+' and 'w\d+' share memory, which the first refit of these weights did not show",
    ),
]

assert all(issubclass(t, CheckpointEngineError) for case in ROUND3_CASES for t in case.expect)


if __name__ == "__main__":
    import sys
    import tempfile

    from tests.reliability.rel_bad_inputs import CASES, markdown_table
    from tests.reliability.rel_hostile_inputs import HOSTILE_CASES

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        print(markdown_table(Path(tmp), CASES + HOSTILE_CASES + ROUND3_CASES))
    sys.stdout.flush()
