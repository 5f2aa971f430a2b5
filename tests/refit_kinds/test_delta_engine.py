"""The ``delta`` engine option (ckpt_core.refit.delta.baselines inside ``BucketedEngine``): refits in a
row arrive bit for bit while small changes travel as patches, and a restarted rollout, a
failed refit or a layout change never yields a wrong weight."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ckpt_core
from ckpt_core.errors import EngineOptionError, IntegrityError
from ckpt_core.hooks import plugin_manager
from ckpt_core.refit.delta import can_pay
from ckpt_core.refit.layout import WeightLayout, slices, whole
from ckpt_core.stats import RefitContext, RefitStats
from ckpt_core.testing.in_process import InProcessEngine, RefitOutcome, run_refit
from ckpt_core.testing.weights import drifting

BUCKET = 1 << 16
PARAMS = {"seed": 3, "elements": 20_000}


def connect(policy: InProcessEngine, rollout: InProcessEngine, extra: dict[str, Any] | None = None) -> None:
    metadata = [policy.prepare(), {**rollout.prepare(), **(extra or {})}]
    sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
    policy.init_policy_process_group(worker_rank=0, **sizes)
    rollout.init_rollout_process_group(rollout_rank=0, **sizes)


def reconnect(policy: InProcessEngine, rollout: InProcessEngine, extra: dict[str, Any] | None = None) -> None:
    policy.finalize()
    rollout.finalize()
    connect(policy, rollout, extra)


def version(k: int) -> list[tuple[str, torch.Tensor]]:
    return list(drifting(PARAMS, refit_index=k, rank=0))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def refit_ok(policy: InProcessEngine, rollout: InProcessEngine, weights: list[tuple[str, torch.Tensor]]) -> int:
    """One refit that must succeed and arrive bit for bit; the bytes it moved."""
    outcome = run_refit(policy, rollout, functools.partial(iter, weights))
    assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
    assert [name for name, _ in outcome.received] == [name for name, _ in weights]
    for (name, got), (_, sent) in zip(outcome.received, weights):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(bits(got), bits(sent)), name
    assert policy.last_stats is not None
    return policy.last_stats.payload_bytes


@pytest.fixture
def pair() -> Iterator[tuple[InProcessEngine, InProcessEngine]]:
    policy, rollout = InProcessEngine(bucket_size=BUCKET, delta=True), InProcessEngine(bucket_size=BUCKET, delta=True)
    connect(policy, rollout)
    yield policy, rollout
    policy.finalize()
    rollout.finalize()


def test_twenty_refits_arrive_bit_for_bit_and_small_changes_move_few_bytes(
    pair: tuple[InProcessEngine, InProcessEngine],
) -> None:
    """Refit k changes 0, 0.01%, 1%, 10% and 100% of every element in turn, over every dtype."""
    policy, rollout = pair
    whole_bytes = refit_ok(policy, rollout, version(0))
    unpatchable = sum(t.nbytes for _, t in version(0) if not can_pay(t))  # complex128, 0-d: always whole
    assert unpatchable < 0.2 * whole_bytes
    previous = None
    for k in range(1, 21):
        moved = refit_ok(policy, rollout, version(k))
        fraction = [0.0, 0.0001, 0.01, 0.1, 1.0][(k - 1) % 5]
        stats = policy.last_stats
        assert stats is not None
        if previous == 1.0:  # sent whole and untracked last refit: whole and tracked again
            assert stats.patched_tensors == 0 and moved >= whole_bytes, (k, stats)
        elif fraction <= 0.01:
            assert moved < unpatchable + 0.1 * (whole_bytes - unpatchable), (k, moved, whole_bytes)
        if fraction == 1.0:
            assert moved >= whole_bytes, (k, moved)  # no patch is smaller: whole again
            assert stats.chosen_whole_tensors == stats.delta_tensors, (k, stats)
        previous = fraction


class FinishedStats:
    """A hook plugin keeping each role's statistics as its ``refit_finished`` hook saw them."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, Any]] = {}

    @ckpt_core.hookimpl
    def ckpt_core_refit_finished(self, context: RefitContext, stats: RefitStats) -> None:
        self.seen[context.role] = stats.to_dict()


def test_statistics_and_hooks_report_the_patches(pair: tuple[InProcessEngine, InProcessEngine]) -> None:
    """A refit that changed 1% of every weight: both sides' statistics, as the hooks see them
    when the refit finishes, count every weight, the patched ones, and exactly the elements
    that changed."""
    policy, rollout = pair
    for k in range(3):
        refit_ok(policy, rollout, version(k))
    weights = version(3)  # 1% of each weight's elements changed since version 2
    changed = sum(round(t.numel() * 0.01) for _, t in weights if can_pay(t))
    observer = FinishedStats()
    plugin_manager().register(observer)
    try:
        refit_ok(policy, rollout, weights)
    finally:
        plugin_manager().unregister(observer)
    for role in ("policy", "rollout"):
        stats = observer.seen[role]
        assert stats["delta_tensors"] == len(weights) and stats["tensors"] == len(weights) + 1, (role, stats)
        assert stats["changed_elements"] == changed, (role, stats)
        # Where a patch (its 8-byte digest included) is fewer bytes than the weight.
        assert stats["patched_tensors"] == sum(1 for _, t in weights if can_pay(t)), (role, stats)
        assert stats["fraction_patched"] == stats["patched_tensors"] / len(weights)
        assert stats["patched_elements"] >= 100 * changed
    assert policy.last_stats is not None and policy.last_stats.to_dict() == observer.seen["policy"]
    held = sum(t.nbytes for _, t in weights if can_pay(t))  # the rest travel whole and untracked
    assert policy.delta_baseline_bytes == rollout.delta_baseline_bytes == held
    assert InProcessEngine(bucket_size=BUCKET).delta_baseline_bytes == 0


def test_a_restarted_rollout_gets_every_weight_whole_then_patches_again(
    pair: tuple[InProcessEngine, InProcessEngine],
) -> None:
    policy, rollout = pair
    whole_bytes = refit_ok(policy, rollout, version(0))
    refit_ok(policy, rollout, version(1))
    rollout.finalize()
    restarted = InProcessEngine(bucket_size=BUCKET, delta=True)  # holds nothing
    policy.finalize()
    connect(policy, restarted)
    assert refit_ok(policy, restarted, version(2)) >= whole_bytes
    assert refit_ok(policy, restarted, version(3)) < 0.25 * whole_bytes
    restarted.finalize()


def failing_after(weights: list[tuple[str, torch.Tensor]], count: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield from weights[:count]
    raise RuntimeError("the trainer failed mid-refit")


def test_a_refit_that_fails_midway_changes_neither_baseline(pair: tuple[InProcessEngine, InProcessEngine]) -> None:
    policy, rollout = pair
    whole_bytes = refit_ok(policy, rollout, version(0))
    outcome: RefitOutcome = run_refit(policy, rollout, functools.partial(failing_after, version(3), 5))
    assert outcome.send_error is not None and outcome.receive_error is not None
    reconnect(policy, rollout)
    # Patches of version 3 against version 0, which both still hold.
    assert refit_ok(policy, rollout, version(3)) < 0.25 * whole_bytes


def test_a_receiver_that_fails_after_its_sender_completed_gets_a_whole_refit(
    pair: tuple[InProcessEngine, InProcessEngine],
) -> None:
    """The receiver stops before taking its refit's end: the sender may have completed (and
    moved its baseline) while the receiver kept its own. Meeting again at init, the versions
    differ and the next refit is whole; either way every weight is right."""
    policy, rollout = pair
    refit_ok(policy, rollout, version(0))
    weights = version(2)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(policy.send_weights(iter(weights)))  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()

    async def take_all_but_the_end() -> None:
        batches = rollout.receive_weight_batches()
        received = 0
        async for batch in batches:
            received += len(batch)
            if received == len(weights):
                break  # every weight taken, the refit's end never asked for
        await batches.aclose()

    asyncio.run(take_all_but_the_end())
    sender.join(30)
    assert not sender.is_alive()
    reconnect(policy, rollout)
    refit_ok(policy, rollout, version(3))
    assert refit_ok(policy, rollout, version(4)) > 0


def test_a_layout_change_still_arrives_right() -> None:
    """With ckpt-engine layouts the baselines hold what the destination kept: after a re-init
    with another layout (here the rank keeps the halves of two weights in the other order),
    the patches are of what it keeps now, against what it kept, and every weight is right."""
    generator = torch.Generator().manual_seed(9)
    weights = [(f"w{i}", torch.randn(64, 32, generator=generator)) for i in range(4)]

    def layout(swapped: bool) -> dict[str, Any]:
        kept = {name: whole(tuple(t.shape)) for name, t in weights}
        if swapped:
            kept.update({name: slices(tuple(t.shape), 0, [(32, 32), (0, 32)]) for name, t in weights[:2]})
        return {"weight_layout": WeightLayout(kept).to_json()}

    options = {"delta": True, "shard_expert_weights": True}
    policy, rollout = InProcessEngine(bucket_size=BUCKET, **options), InProcessEngine(bucket_size=BUCKET, **options)
    try:
        connect(policy, rollout, layout(False))
        assert run_refit(policy, rollout, functools.partial(iter, weights)).receive_error is None
        reconnect(policy, rollout, layout(True))
        changed = [(name, t + 1 if name == "w3" else t) for name, t in weights]
        outcome = run_refit(policy, rollout, functools.partial(iter, changed))
        assert outcome.send_error is None and outcome.receive_error is None
        for (name, got), (_, sent) in zip(outcome.received, changed):
            expected = torch.cat([sent[32:], sent[:32]]) if name in ("w0", "w1") else sent
            assert torch.equal(got, expected), name
    finally:
        policy.finalize()
        rollout.finalize()


def test_delta_on_one_side_only_is_refused_at_init() -> None:
    policy, rollout = InProcessEngine(bucket_size=BUCKET, delta=True), InProcessEngine(bucket_size=BUCKET)
    with pytest.raises(EngineOptionError, match="delta"):
        connect(policy, rollout)


def test_a_bounded_baseline_bounds_both_sides_and_still_patches_what_fits() -> None:
    """``delta_max_baseline_bytes`` on the policy: each side keeps copies of exactly the weights
    that fit in it, in the order sent (the rollout follows the sender's marks, with no option
    of its own); refits arrive bit for bit, and a small change moves the weights past the bound
    (and those no patch can shrink) whole, the rest as patches."""
    weights = version(0)
    bound = sum(t.nbytes for _, t in weights) // 2
    fits, kept_bytes = set(), 0
    for name, tensor in weights:
        if can_pay(tensor) and kept_bytes + tensor.nbytes <= bound:
            fits.add(name)
            kept_bytes += tensor.nbytes
    whole_part = sum(t.nbytes for name, t in weights if name not in fits)
    policy = InProcessEngine(bucket_size=BUCKET, delta=True, delta_max_baseline_bytes=bound)
    rollout = InProcessEngine(bucket_size=BUCKET, delta=True)
    connect(policy, rollout)
    try:
        whole_bytes = refit_ok(policy, rollout, weights)
        for k in range(1, 6):
            moved = refit_ok(policy, rollout, version(k))
            held = 0 if k == 5 else kept_bytes  # k = 5 changed every element: untracked for a refit
            assert policy.delta_baseline_bytes == rollout.delta_baseline_bytes == held and kept_bytes <= bound
            assert moved >= whole_part, (k, moved, whole_part)  # past the bound: whole every time
            if k in (1, 2, 3):  # 0, 0.01%, 1% changed: what is kept travels as patches
                assert moved < whole_part + 0.1 * (whole_bytes - whole_part), (k, moved, whole_part, whole_bytes)
    finally:
        policy.finalize()
        rollout.finalize()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"delta_max_baseline_bytes": 1 << 20}, "delta_max_baseline_bytes bounds delta refits' copies; it needs delta"),
        ({"delta": True, "delta_max_baseline_bytes": -1}, "delta_max_baseline_bytes"),
        ({"delta": True, "delta_max_baseline_bytes": 1.5}, "delta_max_baseline_bytes"),
    ],
)
def test_a_bad_baseline_bound_is_refused(options: dict[str, Any], said: str) -> None:
    with pytest.raises(EngineOptionError, match=said):
        InProcessEngine(bucket_size=BUCKET, **options)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"delta_check": "whole"}, "delta_check checks delta refits' patches; it needs delta=True"),
        ({"delta": True, "delta_check": "sometimes"}, "delta_check"),
    ],
)
def test_a_bad_delta_check_is_refused(options: dict[str, Any], said: str) -> None:
    with pytest.raises(EngineOptionError, match=said):
        InProcessEngine(bucket_size=BUCKET, **options)


def test_with_delta_check_whole_a_write_into_a_handed_weight_fails_the_next_refit() -> None:
    """The rollout hands out its copies; one its caller wrote into, where no patch writes, is
    hashed whole at the next patch (``delta_check="whole"``) and that refit fails naming it."""
    params = {**PARAMS, "fractions": [0.0001]}
    policy = InProcessEngine(bucket_size=BUCKET, delta=True)
    rollout = InProcessEngine(bucket_size=BUCKET, delta=True, delta_check="whole")
    connect(policy, rollout)
    try:
        for k in range(3):
            refit_ok(policy, rollout, list(drifting(params, refit_index=k, rank=0)))
        weights = list(drifting(params, refit_index=3, rank=0))
        outcome = run_refit(policy, rollout, functools.partial(iter, weights))
        assert outcome.send_error is None and outcome.receive_error is None
        name, handed = next((n, t) for n, t in outcome.received if t.dtype == torch.float32 and t.numel() > 1000)
        handed.reshape(-1)[-1] += 1  # the caller writes into a weight it was handed
        outcome = run_refit(policy, rollout, functools.partial(iter, list(drifting(params, refit_index=4, rank=0))))
        assert isinstance(outcome.receive_error, IntegrityError), outcome.receive_error
        assert str(outcome.receive_error).startswith(f"{name}: ")
    finally:
        policy.finalize()
        rollout.finalize()
