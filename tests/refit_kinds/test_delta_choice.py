"""The sender's choice between patches and whole weights (ckpt_core.refit.delta.choice): the cost
model it fits to its refit times, the weights it releases (both baselines drop them at the
manifest) and watches through a sample, and the per-weight choice as a refit's statistics
report it, bit for bit at every changed fraction."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from ckpt_core.refit.delta import compare, sample_changes, take_sample
from ckpt_core.refit.delta.baselines import DeltaReceiver, DeltaSender
from ckpt_core.refit.delta.choice import (
    MIN_EVIDENCE_BYTES,
    RECHECK_AFTER,
    RECHECK_AFTER_MAX,
    RETRACK,
    SURPRISE,
    CostModel,
    RefitCosts,
)
from ckpt_core.stats import RefitStats
from ckpt_core.testing.in_process import connected_pair, run_refit

GB = 10**9


def fitted(*, whole_s_per_gb: float | None, tracked_s_per_gb: float | None = None, slower: float = 1.0) -> CostModel:
    """A model fed refits of 1 GB of bf16 (0.5 G elements): patches costing 0.15 s/GB plus
    10 ns per changed element (times ``slower``), at 0.1% and 1% changed; and whole refits at
    the given costs."""
    model = CostModel()
    for fraction in (0.001, 0.01, 0.001, 0.01):
        changed = int(0.5e9 * fraction)
        model.add(RefitCosts(slower * (0.15 + 10e-9 * changed), 0, 0, GB, changed))
    if tracked_s_per_gb is not None:
        model.add(RefitCosts(tracked_s_per_gb, GB, 0, 0, 0))
    if whole_s_per_gb is not None:
        model.add(RefitCosts(whole_s_per_gb, 0, GB, 0, 0))
    return model


def test_without_evidence_the_choice_is_by_bytes() -> None:
    model = CostModel()
    assert model.per_byte_whole is None and model.per_changed is None
    assert not model.releases(GB, GB // 2, 0.3)  # a tracked weight is compared: bytes decide
    assert model.retracks(GB, GB // 2, 0.3)  # a watched one whose patch is fewer bytes comes back
    model.add(RefitCosts(0.1, 0, 0, MIN_EVIDENCE_BYTES // 2, 1000))  # too little to decide on
    assert model.per_byte_patched is None and not model.releases(GB, GB // 2, 0.3)


def test_one_refit_of_patches_does_not_release_a_weight() -> None:
    """Whole weights measured at 0.3 s/GB; one refit of patches at 0.1% took 0.4 s (the first
    after the copies are made varies most): the weight stays tracked until a second refit of
    patches says so too."""
    model = CostModel()
    model.add(RefitCosts(0.3, 0, GB, 0, 0))
    slow = RefitCosts(0.4, 0, 0, GB, int(0.5e9 * 0.001))
    model.add(slow)
    share = model.patch_share(GB, GB // 2, 0.001)
    assert share is not None and share > 1 and not model.releases(GB, GB // 2, 0.001)
    model.add(slow)
    assert model.releases(GB, GB // 2, 0.001)


def test_the_fit_separates_the_cost_of_bytes_and_of_changed_elements() -> None:
    model = fitted(whole_s_per_gb=0.3)
    assert model.per_byte_patched == pytest.approx(0.15 / GB, rel=0.01)
    assert model.per_changed == pytest.approx(10e-9, rel=0.01)
    assert model.per_byte_whole == pytest.approx(0.3 / GB)


def test_each_refit_added_moves_the_fit_the_next_choices_use() -> None:
    """The fit is solved once per refit added, not per weight asked about; asked after more
    refits (patches now at four times the cost), it is theirs."""
    model = fitted(whole_s_per_gb=0.3)
    assert not model.releases(GB, GB // 2, 0.02)  # the fit is solved here
    for _ in range(8):
        model.add(RefitCosts(0.6, 0, 0, GB, 1000))
    assert model.per_byte_patched == pytest.approx(0.6 / GB, rel=0.05)
    assert model.releases(GB, GB // 2, 0.02)


def test_a_weight_is_released_where_its_patch_is_predicted_slower_and_tracked_again_with_a_margin() -> None:
    """Patch of 1 GB at fraction f: 0.15 + 5 f seconds; whole: 0.3 s. Released from 3%;
    tracked again only at or below 0.8 x 0.3 s (f <= 1.8%), so a weight near 3% stays put."""
    model = fitted(whole_s_per_gb=0.3)
    assert not model.releases(GB, GB // 2, 0.02) and model.releases(GB, GB // 2, 0.04)
    assert model.retracks(GB, GB // 2, 0.01) and not model.retracks(GB, GB // 2, 0.025)


def test_a_slow_wire_keeps_patches_to_a_high_fraction() -> None:
    """At 8 s/GB whole (a 1 Gbit/s link), a patch of 20% (1.15 s) still pays."""
    model = fitted(whole_s_per_gb=8.0)
    assert not model.releases(GB, GB // 2, 0.2)


def test_before_any_untracked_refit_a_patch_near_the_tracked_bound_is_released_to_measure() -> None:
    """Only refits of tracked weights (whose time includes their first refit's faults) bound
    the whole cost: a patch predicted at a quarter of that bound or more is released, which
    measures it; the weight released is not tracked again before then, unless its patch
    became cheaper (at most 0.8 of that quarter)."""
    model = fitted(whole_s_per_gb=None, tracked_s_per_gb=1.2)
    assert not model.releases(GB, GB // 2, 0.02)  # 0.25 s < 0.3 s
    assert model.releases(GB, GB // 2, 0.04)  # 0.35 s >= 0.3 s
    assert not model.retracks(GB, GB // 2, 0.04)  # waits for the untracked time
    assert model.retracks(GB, GB // 2, 0.01)  # 0.2 s <= 0.24 s
    model.add(RefitCosts(0.18, 0, GB, 0, 0))  # measured: 0.18 s/GB untracked, under the patch
    assert not model.retracks(GB, GB // 2, 0.01) and model.releases(GB, GB // 2, 0.01)


def test_one_slow_refit_moves_the_fit_by_at_most_the_surprise_and_a_lasting_change_is_learnt() -> None:
    """Patches of 2.5% (0.275 s, whole 0.3 s) in a steady run; one refit of them at twice that
    (the host busy for a moment) is learnt as 1.25x, so the weight stays tracked, before and
    after a normal refit; the same slowness twice in a row is a change, and is learnt."""
    changed = int(0.5e9 * 0.025)
    patch = RefitCosts(0.15 + 10e-9 * changed, 0, 0, GB, changed)
    model = fitted(whole_s_per_gb=0.3)
    for _ in range(4):
        model.add(patch)
    before = model.patch_share(GB, GB // 2, 0.025)
    assert before is not None and before < 1
    slow = dataclasses.replace(patch, seconds=2 * patch.seconds)
    model.add(slow)
    after = model.patch_share(GB, GB // 2, 0.025)
    assert after is not None and before < after <= SURPRISE * before and not model.releases(GB, GB // 2, 0.025)
    model.add(patch)
    assert not model.releases(GB, GB // 2, 0.025)
    model.add(slow)
    model.add(slow)
    assert model.releases(GB, GB // 2, 0.025)


def whole_refits(model: CostModel, count: int) -> None:
    """``count`` refits of 1 GB sent whole and untracked, at 0.3 s/GB."""
    for _ in range(count):
        model.add(RefitCosts(0.3, 0, GB, 0, 0))


def test_a_slow_spell_that_released_a_weight_is_undone_by_a_recheck() -> None:
    """Steady patches of 2.5% (0.275 s against 0.3 s whole), then a slow spell of three refits
    of them at 1.5x (the first learnt as 1.25x): the weight is released, and refits of whole
    weights teach the patched part nothing. After RECHECK_AFTER of them, the recheck tracks
    again the weight at 2.5% (within 1.5x) but not one at 10%, spares it through the copy and
    the first patch, and the patch then learnt at its steady time is learnt afresh: the
    weight stays tracked. Without the ageing, that one refit would weigh against the slow
    spell's three and release it again."""
    changed = int(0.5e9 * 0.025)
    steady = RefitCosts(0.15 + 10e-9 * changed, 0, 0, GB, changed)
    model = fitted(whole_s_per_gb=0.3)
    for seconds in [steady.seconds] * 4 + [1.5 * steady.seconds] * 3:
        model.add(dataclasses.replace(steady, seconds=seconds))
    assert model.releases(GB, GB // 2, 0.025) and not model.retracks(GB, GB // 2, 0.025)
    whole_refits(model, RECHECK_AFTER - 1)
    assert not model.rechecks(GB, GB // 2, 0.025)
    whole_refits(model, 1)
    assert model.rechecks(GB, GB // 2, 0.025) and not model.rechecks(GB, GB // 2, 0.1)
    model.add(RefitCosts(0.4, GB, 0, 0, 0))  # the copy: the weight is tracked again
    assert not model.rechecks(GB, GB // 2, 0.025)  # the recheck tracks weights in its first refit only
    assert not model.releases(GB, GB // 2, 0.025) and model.releases(GB, GB // 2, 0.1)
    model.add(RefitCosts(0.9, 0, 0, GB, changed, first_patched_bytes=GB))  # the first patch: not learnt
    assert not model.releases(GB, GB // 2, 0.025)
    model.add(steady)
    share = model.patch_share(GB, GB // 2, 0.025)
    assert share is not None and share < 1 and not model.releases(GB, GB // 2, 0.025)
    model.add(steady)  # patches pay again, of their own accord: a later staleness waits RECHECK_AFTER
    whole_refits(model, RECHECK_AFTER)
    assert model.rechecks(GB, GB // 2, 0.025)


def test_a_recheck_that_finds_patches_still_slow_doubles_the_wait_for_the_next() -> None:
    """Where patches really are slower (1.5x, learnt again by each recheck), the weight is
    released after each recheck, and rechecks come after 16, 32, 64, ... refits, at most
    RECHECK_AFTER_MAX apart."""
    model = fitted(whole_s_per_gb=0.3, slower=1.5)
    changed = int(0.5e9 * 0.025)
    waits: list[int] = []
    wait = 1  # the model's own whole refit is the first of the first wait
    for _ in range(4 * RECHECK_AFTER_MAX):
        if len(waits) == 6:
            break
        whole_refits(model, 1)
        wait += 1
        if not model.rechecks(GB, GB // 2, 0.025):
            continue
        waits.append(wait)
        model.add(RefitCosts(0.4, GB, 0, 0, 0))
        model.add(RefitCosts(0.9, 0, 0, GB, changed, first_patched_bytes=GB))
        model.add(RefitCosts(1.5 * (0.15 + 10e-9 * changed), 0, 0, GB, changed))
        assert model.releases(GB, GB // 2, 0.025)
        wait = 0
    assert waits == [RECHECK_AFTER, 2 * RECHECK_AFTER, 4 * RECHECK_AFTER, 8 * RECHECK_AFTER] + [RECHECK_AFTER_MAX] * 2


def test_each_kind_is_learnt_from_its_own_refits_and_not_forgotten() -> None:
    """Refits of patches alone, however many, keep the whole cost measured before; a refit
    sending mostly weights the receiver held until then (paying fresh memory) teaches nothing."""
    model = fitted(whole_s_per_gb=0.3)
    for _ in range(30):
        model.add(RefitCosts(0.2, 0, 0, GB, 5_000_000))
    assert model.per_byte_whole == pytest.approx(0.3 / GB)
    model.add(RefitCosts(5.0, 0, GB, 0, 0, released_bytes=GB))
    assert model.per_byte_whole == pytest.approx(0.3 / GB)


def test_a_refit_mostly_of_first_patches_teaches_nothing() -> None:
    """A copy's first patch hashes it whole on both sides: a refit mostly of such patches is
    not what a steady one pays and leaves the fit as it was; one with a few of them among
    steady patches is learnt from."""
    model = fitted(whole_s_per_gb=0.3)
    model.add(RefitCosts(5.0, 0, 0, GB, 1000, first_patched_bytes=GB))
    assert model.per_byte_patched == pytest.approx(0.15 / GB, rel=0.01)
    for _ in range(8):
        model.add(RefitCosts(0.6, 0, 0, GB, 1000, first_patched_bytes=GB // 10))
    assert model.per_byte_patched == pytest.approx(0.6 / GB, rel=0.05)


def test_a_mixed_refit_credits_its_minor_part_by_the_fit() -> None:
    """A refit of 1 GB whole and 0.2 GB patched at 1%: the patched part is predicted (0.04 s)
    and taken off, the rest teaches the whole cost."""
    model = fitted(whole_s_per_gb=0.3)
    for _ in range(20):
        model.add(RefitCosts(0.5 + 0.04, 0, GB, GB // 5, 1_000_000))
    assert model.per_byte_whole == pytest.approx(0.5 / GB, rel=0.02)


def test_a_screened_comparison_reads_a_sixteenth_and_stops_where_no_patch_can_pay() -> None:
    generator = torch.Generator().manual_seed(1)
    old = (torch.randn(1 << 20, generator=generator) * 0.02).bfloat16()
    for fraction, pays in ((0.01, True), (0.4, False)):
        new = old.clone()
        flips = torch.rand(old.numel(), generator=generator) < fraction
        new.view(torch.int16).bitwise_xor_(flips.to(torch.int16))
        screened = compare(old, new, name="w", encoded=True, screen=True)
        plain = compare(old, new, name="w", encoded=True)
        if pays:
            assert screened.patch is not None and plain.patch is not None and screened.encoded is not None
            assert plain.encoded is not None and torch.equal(screened.encoded, plain.encoded)
        else:
            assert screened.patch is None and screened.compared == old.numel() // 16
            assert abs(screened.changed / screened.compared - fraction) < 0.01


def test_a_sample_counts_the_changes_of_its_ranges_and_follows_the_weight() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(1 << 18, generator=generator)
    sample = take_sample(weight, name="w")
    assert sample.numel() == weight.numel() // 16
    weight[::97] += 1  # every 97th element
    changed, compared = sample_changes(sample, weight, name="w")
    assert compared == sample.numel() and abs(changed - compared / 97) <= 16  # a few per range edge
    assert sample_changes(sample, weight, name="w") == (0, compared)  # refreshed: nothing since


def bf16_model(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {f"w{i}": (torch.randn(1 << 17, generator=generator) * 0.02).bfloat16() for i in range(3)}


def flipped(weights: dict[str, torch.Tensor], fraction: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: flip(tensor, fraction, generator) for name, tensor in weights.items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_released_weights_leave_both_baselines_at_the_manifest_and_come_back_when_they_pay() -> None:
    """With a model that finds patches of 5% slower than whole weights: a refit at 5% patches
    (the fraction is learnt by it), the next releases every weight in its manifest (the
    receiver drops its copies before any weight arrives) and sends them whole, watched; when
    their samples show 1%, they are tracked again (whole), then patched. Bit for bit."""
    generator = torch.Generator().manual_seed(3)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    sender.costs = fitted(whole_s_per_gb=0.3)
    weights = bf16_model(generator)
    steps = [(None, "whole"), (0.05, "patched"), (0.05, "released"), (0.01, "tracked again"), (0.01, "patched")]
    for fraction, expected in steps:
        if fraction is not None:
            weights = flipped(weights, fraction, generator)
        stats, got = RefitStats(), RefitStats()
        entries = sender.encode(iter(weights.items()), stats)
        manifest = next(entries)
        assert receiver.receive(*manifest, got) is None
        if expected == "released":
            assert receiver.baseline.tensors == {} and sender.baseline.tensors == {}  # dropped at the manifest
        received = {}
        for name, tensor in entries:
            entry = receiver.receive(name, tensor, got)
            assert entry is not None
            received[entry[0]] = entry[1].clone()
        receiver.end()
        if expected == "released":  # freeing both sides' copies: no steady refit, nothing learnt
            stats.seconds = 99.0
            sender.commit(stats)
            assert sender.costs.per_byte_whole == pytest.approx(0.3 / GB)
        else:
            sender.commit()
        receiver.commit()
        assert list(received) == list(weights) and all(
            torch.equal(bits(received[n]), bits(weights[n])) for n in weights
        )
        counts = (stats.patched_tensors, stats.whole_tensors, stats.untracked_tensors, stats.chosen_whole_tensors)
        assert counts == {
            "whole": (0, 3, 0, 0),
            "patched": (3, 0, 0, 0),
            "released": (0, 0, 3, 3),
            "tracked again": (0, 3, 0, 0),
        }.get(expected, (3, 0, 0, 0)), (expected, stats)
        assert (got.patched_tensors, got.whole_tensors, got.untracked_tensors) == counts[:3]


def refit_through(sender: DeltaSender, receiver: DeltaReceiver, weights: dict[str, torch.Tensor]) -> RefitStats:
    """One refit of ``weights`` from ``sender`` to ``receiver``, committed on both sides (the
    sender's model learns nothing from it), received bit for bit; the sender's statistics."""
    stats = RefitStats()
    received = {n: t.clone() for n, t in receiver.decode(sender.encode(iter(weights.items()), stats), RefitStats())}
    sender.commit()
    receiver.commit()
    assert list(received) == list(weights) and all(torch.equal(bits(received[n]), bits(weights[n])) for n in weights)
    return stats


def test_weights_released_to_measure_the_whole_cost_come_back_wherever_their_patches_are_faster() -> None:
    """Through a sender and a receiver, weights changing 4% at each refit, with only a tracked
    refit's bound of the whole cost (1.2 s/GB, a quarter of it taken): their patches (0.35 s a
    GB) are predicted slower and released, which measures the whole cost, 0.4 s/GB. The
    patches are faster than that, though not by RETRACK's margin (0.875x): their release was
    no verdict, so they are tracked again at once, and patched. Bit for bit."""
    generator = torch.Generator().manual_seed(7)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    sender.costs = fitted(whole_s_per_gb=None, tracked_s_per_gb=1.2)
    weights = bf16_model(generator)
    steps = ["whole", "patched", "released", "tracked again", "patched"]
    for step in steps:
        if step != "whole":
            weights = flipped(weights, 0.04, generator)
        stats = refit_through(sender, receiver, weights)
        if step == "released":
            sender.costs.add(RefitCosts(0.4, 0, GB, 0, 0))
            share = sender.costs.patch_share(GB, GB // 2, 0.04)
            assert share is not None and RETRACK < share < 1
        counts = (stats.patched_tensors, stats.whole_tensors, stats.untracked_tensors)
        expected = {"whole": (0, 3, 0), "released": (0, 0, 3), "tracked again": (0, 3, 0)}.get(step, (3, 0, 0))
        assert counts == expected, (step, stats)


def test_a_sender_tracks_released_weights_again_for_a_recheck_and_reports_them() -> None:
    """Through a sender and a receiver, weights changing 2.5% at each refit: its model learnt
    patches of them slower than whole weights in a slow spell, so the second refit of patches
    releases them; after RECHECK_AFTER refits of whole weights (fed to its model), its recheck
    tracks them again (``rechecked_tensors``), keeps them through the copy and the first patch,
    and, the patch then learnt at its steady time, patches them from then on. Bit for bit."""
    generator = torch.Generator().manual_seed(6)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    changed = int(0.5e9 * 0.025)
    steady = RefitCosts(0.15 + 10e-9 * changed, 0, 0, GB, changed)
    sender.costs = fitted(whole_s_per_gb=0.3)
    for seconds in [steady.seconds] * 4 + [1.5 * steady.seconds] * 3:
        sender.costs.add(dataclasses.replace(steady, seconds=seconds))
    weights = bf16_model(generator)
    lessons = {  # what the model learns after each refit, as the refit's time would teach it
        "released": [RefitCosts(0.3, 0, GB, 0, 0)] * RECHECK_AFTER,
        "rechecked": [RefitCosts(0.4, GB, 0, 0, 0)],
        "first patches": [RefitCosts(0.9, 0, 0, GB, changed, first_patched_bytes=GB)],
        "spared": [steady],
    }
    steps = ["whole", "patched", "released", "rechecked", "first patches", "spared", "patched"]
    for step in steps:
        if step != "whole":
            weights = flipped(weights, 0.025, generator)
        stats = refit_through(sender, receiver, weights)
        for lesson in lessons.get(step, []):
            sender.costs.add(lesson)
        counts = (stats.patched_tensors, stats.whole_tensors, stats.untracked_tensors, stats.rechecked_tensors)
        assert counts == {
            "whole": (0, 3, 0, 0),
            "released": (0, 0, 3, 0),
            "rechecked": (0, 3, 0, 3),
        }.get(step, (3, 0, 0, 0)), (step, stats)


def test_the_sender_does_not_learn_from_the_first_patch_of_its_copies() -> None:
    """Through a sender: its first refit of patches after the weights were sent whole (each
    copy hashed whole) leaves its model as it was, however long it took; its second one is
    learnt from."""
    generator = torch.Generator().manual_seed(5)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    sender.costs = fitted(whole_s_per_gb=0.3)
    weights = bf16_model(generator)
    learnt = []
    for refit in range(3):
        if refit:
            weights = flipped(weights, 0.01, generator)
        stats = RefitStats()
        for name, tensor in receiver.decode(sender.encode(iter(weights.items()), stats), RefitStats()):
            assert torch.equal(bits(tensor), bits(weights[name]))
        assert stats.patched_tensors == (3 if refit else 0)
        before = sender.costs.per_byte_patched
        stats.seconds = 99.0  # far slower than the model's patches: moves the fit where learnt
        sender.commit(stats)
        receiver.commit()
        learnt.append(sender.costs.per_byte_patched != before)
    assert learnt == [False, False, True]


def test_a_refit_that_fails_after_its_manifest_released_weights_sends_them_whole_next() -> None:
    """Released weights leave both baselines whether or not the refit completes: after a failed
    one, the next refit sends them whole (there is nothing to patch them against on either side)."""
    generator = torch.Generator().manual_seed(4)
    sender, receiver = DeltaSender(destination="rollout 0"), DeltaReceiver(source="policy 0")
    sender.costs = fitted(whole_s_per_gb=0.3)
    weights = bf16_model(generator)
    for fraction in (None, 0.05):
        if fraction is not None:
            weights = flipped(weights, fraction, generator)
        list(receiver.decode(sender.encode(iter(weights.items()), RefitStats()), RefitStats()))
        sender.commit()
        receiver.commit()
    failing = flipped(weights, 0.01, generator)
    stream = receiver.decode(sender.encode(iter(failing.items()), RefitStats()), RefitStats())
    next(stream)  # the manifest (releasing all three) and the first weight went through
    stream.close()
    sender.discard()
    receiver.discard()
    assert sender.baseline.tensors == {} and receiver.baseline.tensors == {}
    assert sender.baseline.version == receiver.baseline.version
    stats = RefitStats()
    received = {n: t.clone() for n, t in receiver.decode(sender.encode(iter(failing.items()), stats), RefitStats())}
    assert stats.patched_tensors == 0 and all(torch.equal(bits(received[n]), bits(failing[n])) for n in failing)


def test_a_receiver_that_owns_what_it_receives_keeps_whole_weights_as_they_arrived() -> None:
    weight = torch.arange(64, dtype=torch.float32)
    for keeps, same in ((True, True), (False, False)):
        sender = DeltaSender(destination="rollout 0")
        receiver = DeltaReceiver(source="policy 0", keeps_received=keeps)
        received = dict(receiver.decode(sender.encode(iter({"w": weight}.items()), RefitStats()), RefitStats()))
        sender.commit()
        receiver.commit()
        assert (receiver.baseline.tensors["w"] is received["w"]) is same
        assert torch.equal(receiver.baseline.tensors["w"], weight)


def mixed(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights whose patches pay up to different fractions: bf16 (6 bytes a changed element
    against 2: below 33%), fp32 (8 against 4: below 50%), uint8 (5 against 1: below 20%)."""
    return {
        "bf16": torch.randn(40_000, generator=generator).bfloat16(),
        "fp32": torch.randn(40_000, generator=generator),
        "uint8": torch.randint(0, 255, (40_000,), generator=generator, dtype=torch.uint8),
    }


def test_refits_at_every_fraction_arrive_bit_for_bit_each_weight_chosen_by_what_its_patch_costs() -> None:
    """Through an engine pair (the in-process transport: the real pipeline, statistics and
    hooks), 0%, 1%, 40% and 100% of the elements changed in turn: every weight arrives bit for
    bit, and the statistics show the choice made for each: at 40% only the fp32 weight's patch
    is fewer bytes; at 100% none is; the refit after a weight went whole sends it whole and
    tracked again."""
    generator = torch.Generator().manual_seed(5)
    weights = mixed(generator)
    policy, rollout = connected_pair(1 << 16, delta=True)
    expected = {  # fraction -> (patched, whole and tracked, untracked by the choice)
        None: (0, 3, 0),
        0.0: (3, 0, 0),
        0.01: (3, 0, 0),
        0.4: (1, 0, 2),
        1.0: (0, 0, 3),
        0.001: (0, 3, 0),
    }
    try:
        for fraction in (None, 0.0, 0.01, 0.4, 1.0, 0.001):
            if fraction is not None:
                weights = {name: flip(tensor, fraction, generator) for name, tensor in weights.items()}
            outcome = run_refit(policy, rollout, functools.partial(iter, list(weights.items())))
            assert outcome.send_error is None and outcome.receive_error is None
            assert [name for name, _ in outcome.received] == list(weights)
            for (name, got), sent in zip(outcome.received, weights.values()):
                assert got.dtype == sent.dtype and torch.equal(bits(got), bits(sent)), (fraction, name)
            for engine in (policy, rollout):
                stats = engine.last_stats
                assert stats is not None
                made = (stats.patched_tensors, stats.whole_tensors, stats.untracked_tensors)
                assert made == expected[fraction], (fraction, engine, stats)
            assert policy.last_stats is not None and policy.last_stats.chosen_whole_tensors == expected[fraction][2]
    finally:
        policy.finalize()
        rollout.finalize()


def flip(tensor: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """``tensor`` with the lowest bit of each element flipped with probability ``fraction``."""
    flips = torch.rand(tensor.numel(), generator=generator) < fraction
    flipped = tensor.clone()
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]
    flipped.view(integer).bitwise_xor_(flips.to(integer))
    return flipped
