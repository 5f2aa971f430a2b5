"""Delta refits' stages (ckpt_core.refit.delta.baselines): a sender's patches turned back into whole
weights by its receiver, bit for bit, over refits in a row; and never a wrong weight when the
two sides' baselines differ or a refit fails."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from ckpt_core._internal import bitdiff
from ckpt_core.errors import IntegrityError, LifecycleError, WireFormatError
from ckpt_core.refit.delta import can_pay, digest
from ckpt_core.refit.delta.baselines import (
    MANIFEST_NAME,
    PATCH_SUFFIX,
    UNTRACKED_SUFFIX,
    BaselineMismatchError,
    DeltaReceiver,
    DeltaSender,
)
from ckpt_core.stats import RefitStats
from ckpt_core.testing.in_process import connected_pair, run_refit

# Each refit changes this fraction of every weight's elements, in turn.
FRACTIONS = [0.0, 0.0001, 0.01, 0.1, 1.0]


def model(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights of every kind a refit carries, 0-d and empty ones included."""
    return {
        "bf16": torch.randn(128, 96, generator=generator).bfloat16(),
        "fp32": torch.randn(5000, generator=generator),
        "fp16": torch.randn(40, 40, generator=generator).half(),
        "fp8": torch.randn(64, 64, generator=generator).to(torch.float8_e4m3fn),
        "int64": torch.randint(-1000, 1000, (3000,), generator=generator),
        "bool": torch.rand(2000, generator=generator) > 0.5,
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 8),
    }


def step(weights: dict[str, torch.Tensor], fraction: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The next version: ``fraction`` of each weight's elements flipped in their lowest bit."""
    new = {}
    for name, tensor in weights.items():
        tensor = tensor.clone()
        count = round(tensor.numel() * fraction)
        if count:
            flat = tensor.reshape(-1).view(torch.uint8).view(tensor.numel(), tensor.element_size())
            flat[torch.randperm(tensor.numel(), generator=generator)[:count], 0] ^= 1
        new[name] = tensor
    return new


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def carried(entries: Iterator[tuple[str, torch.Tensor]], stats: RefitStats) -> Iterator[tuple[str, torch.Tensor]]:
    """``entries`` as a pipeline carries them, counting what it counts: entries and bytes."""
    for name, tensor in entries:
        stats.tensors += 1
        stats.payload_bytes += tensor.numel() * tensor.element_size()
        yield name, tensor


def refit(
    sender: DeltaSender,
    receiver: DeltaReceiver,
    weights: dict[str, torch.Tensor],
    sent: RefitStats | None = None,
    got: RefitStats | None = None,
) -> dict[str, torch.Tensor]:
    """One refit through both stages (as the pipeline would carry it), committed on both; each
    side's account in ``sent`` and ``got``."""
    sent, got = sent or RefitStats(), got or RefitStats()
    entries = carried(sender.encode(iter(weights.items()), sent), sent)
    received = {name: tensor.clone() for name, tensor in receiver.decode(entries, got)}
    sender.commit()
    receiver.commit()
    return received


def assert_same(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert list(received) == list(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
        assert torch.equal(bits(received[name]), bits(tensor)), f"{name} differs"


def test_refits_in_a_row_arrive_bit_for_bit_and_small_changes_travel_as_patches() -> None:
    """Each weight a patch can pay for is patched where fewer bytes, else sent whole and
    untracked, then tracked again (whole) the refit after; weights no patch can pay for (0-d,
    empty) always travel whole and untracked. Both sides count every choice alike."""
    generator = torch.Generator().manual_seed(0)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = model(generator)
    trackable = [name for name, tensor in weights.items() if can_pay(tensor)]
    assert len(trackable) == 6 and "scalar" not in trackable and "empty" not in trackable
    stats = RefitStats()
    assert_same(refit(sender, receiver, weights, stats), weights)
    assert stats.patched_tensors == 0 and stats.delta_tensors == len(weights)  # nothing to patch against yet
    assert (stats.whole_tensors, stats.chosen_whole_tensors) == (6, 2)
    previous = None
    for k in range(21):
        fraction = FRACTIONS[k % len(FRACTIONS)]
        weights = step(weights, fraction, generator)
        stats, got = RefitStats(), RefitStats()
        assert_same(refit(sender, receiver, weights, stats, got), weights)
        delta_fields = ("delta_tensors", "patched_tensors", "patched_elements", "changed_elements", "whole_tensors")
        assert [getattr(got, f) for f in delta_fields] == [getattr(stats, f) for f in delta_fields]
        assert got.untracked_tensors == stats.untracked_tensors
        assert stats.tensors == stats.delta_tensors + 1  # and the manifest
        assert stats.delta_tensors == stats.patched_tensors + stats.whole_tensors + stats.untracked_tensors
        whole_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        changed = sum(round(t.numel() * fraction) for t in weights.values() if t.numel() > 1)
        if previous == 1.0:  # sent untracked last refit: whole and tracked again
            assert (stats.patched_tensors, stats.whole_tensors, stats.chosen_whole_tensors) == (0, 6, 2), stats
        elif fraction <= 0.01:
            assert stats.patched_tensors == 6 and stats.payload_bytes < 0.1 * whole_bytes, stats
            assert stats.changed_elements == changed, (stats, changed)
        if fraction == 1.0:  # compared, no patch is fewer bytes: whole and untracked
            assert stats.patched_tensors == 0 and stats.payload_bytes >= whole_bytes, stats
            assert stats.chosen_whole_tensors == stats.untracked_tensors == len(weights), stats
        previous = fraction
    assert sender.baseline.version == receiver.baseline.version
    assert sorted(sender.baseline.tensors) == sorted(receiver.baseline.tensors) == sorted(trackable)
    assert sender.baseline.nbytes == receiver.baseline.nbytes == sum(weights[name].nbytes for name in trackable)


@pytest.mark.parametrize("bound", [0, 30_000, 60_000])
def test_a_bounded_baseline_keeps_what_fits_on_both_sides_and_sends_the_rest_whole(bound: int) -> None:
    """A sender bounded to ``bound`` bytes of copies keeps the weights that fit, in the order
    sent, and no more; its receiver keeps the same ones (the rest arrive untracked); weights
    past the bound travel whole at every refit, the others patched; every refit arrives bit
    for bit, over refits whose changes vary."""
    generator = torch.Generator().manual_seed(7)
    sender = DeltaSender(destination="rollout 0", max_baseline_bytes=bound)
    receiver = DeltaReceiver(source="policy 0")
    weights = model(generator)
    fits, total = [], 0
    for name, tensor in weights.items():
        if can_pay(tensor) and total + tensor.nbytes <= bound:  # the rest can only travel whole
            fits.append(name)
            total += tensor.nbytes
    assert 0 < len(fits) < len(weights) or bound == 0, fits  # the bound cuts the model somewhere
    assert_same(refit(sender, receiver, weights), weights)
    for k in range(6):
        fraction = FRACTIONS[k % len(FRACTIONS)] or 0.01
        weights = step(weights, fraction, generator)
        stats = RefitStats()
        assert_same(refit(sender, receiver, weights, stats), weights)
        held = [] if fraction == 1.0 else fits  # all changed: untracked for a refit, their places kept
        assert sorted(sender.baseline.tensors) == sorted(receiver.baseline.tensors) == sorted(held)
        assert sender.baseline.nbytes == receiver.baseline.nbytes == sum(weights[name].nbytes for name in held)
        assert total <= bound
        untracked_bytes = sum(t.nbytes for name, t in weights.items() if name not in fits)
        assert stats.payload_bytes >= untracked_bytes  # the weights past the bound: whole every time
        if k and FRACTIONS[k - 1] == 1.0:  # tracked again: whole
            assert (stats.patched_tensors, stats.whole_tensors) == (0, len(fits)), (stats, fits)
        elif FRACTIONS[k % len(FRACTIONS)] in (0.0, 0.0001, 0.01):
            assert stats.patched_tensors == len(fits), (stats, fits)


def test_an_untracked_weight_sent_twice_is_refused() -> None:
    sender = DeltaSender(destination="rollout 0", max_baseline_bytes=0)
    weights = iter([("w", torch.ones(4)), ("w", torch.ones(4))])
    with pytest.raises(WireFormatError, match="yields weight 'w' twice"):
        list(sender.encode(weights, RefitStats()))
    entries = list(
        DeltaSender(destination="rollout 0", max_baseline_bytes=0).encode(iter([("w", torch.ones(4))]), RefitStats())
    )
    manifest, (name, tensor) = entries
    assert name == "w" + UNTRACKED_SUFFIX
    with pytest.raises(WireFormatError, match="sent weight 'w' twice"):
        list(DeltaReceiver(source="policy 0").decode(iter([manifest, (name, tensor), ("w", tensor)]), RefitStats()))


def test_a_refit_that_fails_midway_leaves_both_baselines_as_they_were() -> None:
    generator = torch.Generator().manual_seed(1)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = model(generator)
    refit(sender, receiver, weights)
    weights = step(weights, 0.01, generator)
    refit(sender, receiver, weights)  # the receiver knows its patched copies' terms from here on
    held = sender.baseline
    failed = step(weights, 0.01, generator)
    stream = receiver.decode(sender.encode(iter(failed.items()), RefitStats()), RefitStats())
    for _ in range(3):
        next(stream)
    stream.close()  # the transport failed after three weights
    sender.discard()
    receiver.discard()
    with pytest.raises(LifecycleError, match="no decoded refit to commit"):
        receiver.commit()
    assert sender.baseline is held
    for _ in range(2):  # made from terms the failed refit left as they were
        later, stats = step(failed, 0.01, generator), RefitStats()
        assert_same(refit(sender, receiver, later, stats), later)
        assert stats.patched_tensors >= 6
        failed = later


def test_a_receiver_holding_another_version_refuses_the_patches_and_a_whole_refit_recovers() -> None:
    """A restarted rollout (nothing held), and one whose last refit failed after its sender
    completed: each refuses at the manifest, before any weight; after ``forget`` the sender's
    whole refit is taken."""
    generator = torch.Generator().manual_seed(2)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = model(generator)
    refit(sender, receiver, weights)
    for restarted in (True, False):
        weights = step(weights, 0.01, generator)
        if restarted:
            receiver = DeltaReceiver(source="policy 0")
        else:  # the sender committed a refit its receiver did not
            list(sender.encode(iter(weights.items()), RefitStats()))
            sender.commit()
            weights = step(weights, 0.01, generator)
        held = receiver.baseline
        with pytest.raises(BaselineMismatchError, match="nothing was applied"):
            next(receiver.decode(sender.encode(iter(weights.items()), RefitStats()), RefitStats()))
        assert receiver.baseline is held
        sender.forget()
        stats = RefitStats()
        assert_same(refit(sender, receiver, weights, stats), weights)
        assert stats.patched_tensors == 0
        weights, stats = step(weights, 0.01, generator), RefitStats()
        assert_same(refit(sender, receiver, weights, stats), weights)
        assert stats.patched_tensors >= 6


def test_the_senders_digests_follow_its_copies_across_refits_and_a_wrong_one_is_caught() -> None:
    """The sender keeps each patched copy's digest and makes the next from the changes alone:
    after refits at every fraction, each kept digest is its copy's; one that is not (a sender
    bug) is caught by the receiver, which hashes its whole copy."""
    generator = torch.Generator().manual_seed(5)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = model(generator)
    refit(sender, receiver, weights)
    for fraction in [0.01, 0.0, 0.001, 0.01]:
        weights = step(weights, fraction, generator)
        assert_same(refit(sender, receiver, weights), weights)
        patched = sender.baseline.digests
        assert {"bf16", "fp32", "int64"} <= patched.keys()
        for name, value in patched.items():
            assert value == digest(sender.baseline.tensors[name]), name
    sender.baseline.digests["bf16"] ^= 1
    with pytest.raises(IntegrityError, match="bf16: patched from policy 0's patch, it does not match"):
        list(receiver.decode(sender.encode(iter(step(weights, 0.01, generator).items()), RefitStats()), RefitStats()))


def test_a_patch_that_does_not_give_the_senders_weight_is_an_integrity_error() -> None:
    generator = torch.Generator().manual_seed(3)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = model(generator)
    refit(sender, receiver, weights)
    receiver.baseline.tensors["fp32"][7] += 1  # the receiver's copy went wrong
    with pytest.raises(IntegrityError, match="fp32: patched from policy 0's patch, it does not match"):
        list(receiver.decode(sender.encode(iter(step(weights, 0.01, generator).items()), RefitStats()), RefitStats()))


@pytest.mark.parametrize("whole_check, found_at", [(False, 15), (True, 1)], ids=["audit", "whole"])
def test_a_write_into_a_received_weight_is_found_by_the_patch_that_reads_it(
    whole_check: bool, found_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write into a received copy where no patch writes: with the default check, each patch
    after the copy's first audits the next class of its leaves, and the one that reads the
    written leaf fails its refit (``IntegrityError`` naming the weight); with ``whole_check``,
    the next patch does."""
    monkeypatch.setattr(bitdiff, "LEAF_BYTES", 64)  # 16 KiB: 256 leaves, 16 per class
    generator = torch.Generator().manual_seed(6)
    weights = {"w": torch.randn(4096, generator=generator)}
    sender = DeltaSender(destination="rollout 0")
    receiver = DeltaReceiver(source="policy 0", whole_check=whole_check)
    refit(sender, receiver, weights)
    weights = step(weights, 0.01, generator)
    refit(sender, receiver, weights)  # the copy's first patch: hashed whole
    receiver.baseline.tensors["w"][1000] += 1  # byte 4000: leaf 62, of class 14
    said = "changed where no patch wrote (its leaves of class 14" if not whole_check else "does not match"
    found = None
    for patches in range(1, 17):
        weights = step(weights, 0.001, generator)
        try:
            refit(sender, receiver, weights)
        except IntegrityError as exc:
            assert str(exc).startswith("w: ") and said in str(exc)
            found = patches
            break
    assert found == found_at


def test_weights_that_change_shape_or_appear_travel_whole_and_dropped_ones_leave_the_baseline() -> None:
    generator = torch.Generator().manual_seed(4)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = model(generator)
    refit(sender, receiver, weights)
    changed = step(weights, 0.01, generator)
    changed["bf16"] = changed["bf16"][:64]  # another layout's shard
    changed["new"] = torch.ones(10)
    del changed["fp32"]
    names = [name for name, _ in sender.encode(iter(changed.items()), RefitStats())]
    sender.discard()
    assert "bf16" in names and "new" in names and "fp16" + PATCH_SUFFIX in names
    assert_same(refit(sender, receiver, changed), changed)
    assert "fp32" not in sender.baseline.tensors and "fp32" not in receiver.baseline.tensors


def test_received_whole_weights_are_kept_by_copy() -> None:
    """A receiver hands on whole weights as received (views of a transport buffer, say) and
    keeps its own copy: the buffer's reuse does not change its baseline."""
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    buffer = torch.arange(8, dtype=torch.float32)

    def lent() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in sender.encode(iter({"w": buffer.clone()}.items()), RefitStats()):
            yield name, tensor
            if name == "w":
                tensor.zero_()  # refilled once the next batch is asked for

    list(receiver.decode(lent(), RefitStats()))
    sender.commit()
    receiver.commit()
    assert torch.equal(receiver.baseline.tensors["w"], torch.arange(8, dtype=torch.float32))


@pytest.mark.parametrize(
    ("first", "said"),
    [
        (None, "starts with its manifest, got nothing"),
        (("w", torch.zeros(3)), "starts with its manifest, got 'w'"),
        ((MANIFEST_NAME, torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8)), "manifest from policy 0 is malformed"),
    ],
)
def test_a_stream_without_a_good_manifest_is_refused(first: tuple[str, torch.Tensor] | None, said: str) -> None:
    with pytest.raises(WireFormatError, match=said):
        list(DeltaReceiver(source="policy 0").decode(iter([first] if first else []), RefitStats()))


def test_a_patch_of_the_wrong_size_is_refused() -> None:
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    refit(sender, receiver, {"w": torch.zeros(100)})
    stream = sender.encode(iter({"w": torch.zeros(100).index_fill_(0, torch.tensor([3]), 1.0)}.items()), RefitStats())
    manifest, (name, blob) = next(stream), next(stream)
    assert blob.numel() == 8 + 8 + 4  # the digest, one position padded to 8 bytes, one value
    with pytest.raises(WireFormatError, match="w: a patch of 19 bytes does not hold whole elements"):
        list(receiver.decode(iter([manifest, (name, blob[:-1])]), RefitStats()))


def test_patches_travel_through_an_engines_pipeline() -> None:
    """The stages around a real engine pair (the in-process transport: buckets packed, the wire
    format, chunks): patch names and blobs survive it, and a refit that changed 1% moves a
    tenth of the bytes of the first, whole one."""
    generator = torch.Generator().manual_seed(5)
    policy, rollout = connected_pair(1 << 16)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    weights = {name: tensor for name, tensor in model(generator).items()}
    weights["big"] = torch.randn(256, 256, generator=generator)  # chunked across buckets
    payloads = []
    try:
        for fraction in (None, 0.01, 0.0, 0.01):
            if fraction is not None:
                weights = step(weights, fraction, generator)
            outcome = run_refit(policy, rollout, functools.partial(sender.encode, iter(weights.items()), RefitStats()))
            assert outcome.send_error is None and outcome.receive_error is None
            received = {name: tensor.clone() for name, tensor in receiver.decode(iter(outcome.received), RefitStats())}
            sender.commit()
            receiver.commit()
            assert_same(received, weights)
            assert policy.last_stats is not None
            payloads.append(policy.last_stats.payload_bytes)
    finally:
        policy.finalize()
        rollout.finalize()
    assert max(payloads[1:]) < 0.1 * payloads[0], payloads
