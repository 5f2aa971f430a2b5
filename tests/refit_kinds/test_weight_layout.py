"""Destination layouts (``ckpt_core.refit.layout``): each rollout rank receives only what it keeps.

The layouts here are of the kind a tensor-parallel, expert-parallel rollout has: attention
sharded by rows (``q/k/v_proj``) or columns (``o_proj``), experts owned whole by one rank,
norms, router, embeddings and head replicated. Checked: what arrives is bit-exact the part of
the sender's tensor the layout names, a rank's received bytes are its kept bytes, and bad
layouts or layouts of another model are refused with the weight named. Alternative namings:
experts a trainer holds fused in memory or names one tensor per expert select the same
elements, and a stream must bring exactly one naming of each group, all of it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_core.errors import RemoteRefitError, WeightLayoutError
from ckpt_core.refit.layout import (
    LAYOUT_FORMAT,
    LAYOUT_VERSION,
    AlternativeNaming,
    KeptWeight,
    WeightLayout,
    check_layouts,
    nothing,
    select_weights,
    slices,
    whole,
)
from ckpt_core.testing.in_process import InProcessEngine, run_refit
from ckpt_core.testing.weights import tiny_moe, tiny_moe_layout

BUCKET = 16 << 10
MOE: dict[str, Any] = {"seed": 3, "layers": 2, "experts": 4}


def moe_shapes(params: dict[str, Any] = MOE) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tiny_moe(params, refit_index=0, rank=0)}


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-exact equality (the weights are random bytes: NaNs compare unequal as values)."""
    assert a is not None
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def connected(layout: dict[str, Any], **options: Any) -> tuple[InProcessEngine, InProcessEngine]:
    """A policy and a rollout engine whose rollout publishes ``layout`` in its metadata."""
    policy = InProcessEngine(bucket_size=BUCKET, shard_expert_weights=True, **options)
    rollout = InProcessEngine(bucket_size=BUCKET, shard_expert_weights=True, **options)
    metadata = [policy.prepare(), {**rollout.prepare(), "weight_layout": layout}]
    policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    return policy, rollout


# --- the format ----------------------------------------------------------------------------


def test_a_layout_round_trips_through_json_and_selects_its_parts() -> None:
    shapes = moe_shapes()
    layout = tiny_moe_layout(shapes, rank=1, world_size=2)
    again = WeightLayout.from_json(layout.to_json())
    assert again == layout and again.to_json()["format"] == LAYOUT_FORMAT
    weights = dict(tiny_moe(MOE, refit_index=0, rank=0))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    kept = again.weights["model.layers.0.self_attn.q_proj.weight"]
    assert same_bits(kept.select(q), q[32:])
    assert kept.received_shape == (32, 64)
    fused = slices((6, 2), 0, [(4, 2), (0, 1)])  # parts in the order received, concatenated
    source = torch.arange(12.0).reshape(6, 2)
    assert same_bits(fused.select(source), torch.cat([source[4:6], source[0:1]]))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"shape": [8, 4], "keep": {"dim": 0, "parts": [[6, 4]]}}, "ends at 10, past dimension 0 of size 8"),
        ({"shape": [8, 4], "keep": {"dim": 0, "parts": [[0, 4], [3, 2]]}}, "overlap along dimension 0"),
        ({"shape": [8, 4], "keep": {"dim": 2, "parts": [[0, 1]]}}, "dim 2 is not a dimension"),
        ({"shape": [8, 4], "keep": {"dim": 0, "parts": [[0, 0]]}}, "length >= 1"),
        ({"shape": [8, 4], "keep": "half"}, "'keep' must be 'whole', 'none'"),
        ({"shape": [8, -4], "keep": "whole"}, "non-negative ints"),
        ({"keep": "whole"}, "exactly 'shape' and 'keep'"),
    ],
    ids=["out_of_bounds", "overlapping", "bad_dim", "empty_part", "bad_keep", "bad_shape", "no_shape"],
)
def test_a_malformed_entry_is_refused_naming_the_weight(entry: dict[str, Any], message: str) -> None:
    data = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "weights": {"w.weight": entry}}
    with pytest.raises(WeightLayoutError, match="weight 'w.weight'") as refused:
        WeightLayout.from_json(data)
    assert message in str(refused.value)


def test_layouts_of_all_ranks_must_describe_one_model_and_lose_nothing() -> None:
    shapes = moe_shapes()
    layouts = {rank: tiny_moe_layout(shapes, rank, 2) for rank in range(2)}
    check_layouts(layouts, owner="test")  # the sharded pair covers everything

    name = "model.layers.1.self_attn.o_proj.weight"
    gap = {**layouts[1].weights, name: slices(shapes[name], 1, [(32, 16)])}  # misses columns 48..63
    with pytest.raises(WeightLayoutError, match=f"index 48 of dimension 1 of weight '{name}'"):
        check_layouts({0: layouts[0], 1: WeightLayout(gap)}, owner="test")

    expert = "model.layers.0.mlp.experts.2.up_proj.weight"  # owned by rank 0
    lost = {**layouts[0].weights, expert: nothing(shapes[expert])}
    with pytest.raises(WeightLayoutError, match=f"no rollout rank keeps any of weight '{expert}'"):
        check_layouts({0: WeightLayout(lost), 1: layouts[1]}, owner="test")

    other_model = {**layouts[1].weights, expert: nothing((99, 64))}
    with pytest.raises(WeightLayoutError, match="layouts of different models"):
        check_layouts({0: layouts[0], 1: WeightLayout(other_model)}, owner="test")

    crossed = {**layouts[1].weights, name: slices(shapes[name], 0, [(0, 64)])}
    with pytest.raises(WeightLayoutError, match="sliced along different dimensions"):
        check_layouts({0: layouts[0], 1: WeightLayout(crossed)}, owner="test")

    fewer = dict(layouts[1].weights)
    del fewer["model.norm.weight"]
    with pytest.raises(WeightLayoutError, match="describe different weights"):
        check_layouts({0: layouts[0], 1: WeightLayout(fewer)}, owner="test")


# --- alternative namings: experts fused in memory, or one tensor per expert ------------------

EXPERTS, INTER, HIDDEN = 4, 6, 4
FUSED_PREFIX = "model.layers.0.mlp.experts"


def per_expert_weights(fused: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same weights one tensor per expert, in checkpoint naming: gate rows first, then up."""
    tensors = dict(fused)
    gate_up, down = tensors.pop(f"{FUSED_PREFIX}.gate_up_proj"), tensors.pop(f"{FUSED_PREFIX}.down_proj")
    experts = []
    for e in range(EXPERTS):
        experts += [
            (f"{FUSED_PREFIX}.{e}.gate_proj.weight", gate_up[e, :INTER].clone()),
            (f"{FUSED_PREFIX}.{e}.up_proj.weight", gate_up[e, INTER:].clone()),
            (f"{FUSED_PREFIX}.{e}.down_proj.weight", down[e].clone()),
        ]
    return [("model.norm.weight", tensors["model.norm.weight"]), *experts]


def fused_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A trainer's in-memory weights (transformers 5 holds experts fused)."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.norm.weight", torch.randn(HIDDEN, generator=g)),
        (f"{FUSED_PREFIX}.gate_up_proj", torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)),
        (f"{FUSED_PREFIX}.down_proj", torch.randn(EXPERTS, HIDDEN, INTER, generator=g)),
    ]


def experts_layout(rank: int, parallel: str, world_size: int = 2) -> WeightLayout:
    """Rank ``rank`` of ``world_size``: ``"tp"`` keeps its share of every expert's intermediate
    dim (rows of gate and of up, columns of down); ``"ep"`` keeps its share of the experts
    whole. Both namings described, the per-expert one as the layout's weights."""
    part, owned = INTER // world_size, EXPERTS // world_size
    weights: dict[str, KeptWeight] = {"model.norm.weight": whole([HIDDEN])}
    for e in range(EXPERTS):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shape = (HIDDEN, INTER) if proj == "down_proj" else (INTER, HIDDEN)
            name = f"{FUSED_PREFIX}.{e}.{proj}.weight"
            if parallel == "ep":
                weights[name] = whole(shape) if e // owned == rank else nothing(shape)
            else:
                weights[name] = slices(shape, 1 if proj == "down_proj" else 0, [(rank * part, part)])
    if parallel == "ep":
        gate_up = slices((EXPERTS, 2 * INTER, HIDDEN), 0, [(rank * owned, owned)])
        down = slices((EXPERTS, HIDDEN, INTER), 0, [(rank * owned, owned)])
    else:
        gate_up = slices((EXPERTS, 2 * INTER, HIDDEN), 1, [(rank * part, part), (INTER + rank * part, part)])
        down = slices((EXPERTS, HIDDEN, INTER), 2, [(rank * part, part)])
    gate_up_names = tuple(n for n in weights if n.endswith(("gate_proj.weight", "up_proj.weight")))
    down_names = tuple(n for n in weights if n.endswith("down_proj.weight"))
    return WeightLayout(
        weights,
        (
            AlternativeNaming(gate_up_names, {f"{FUSED_PREFIX}.gate_up_proj": gate_up}),
            AlternativeNaming(down_names, {f"{FUSED_PREFIX}.down_proj": down}),
        ),
    )


@pytest.mark.parametrize("parallel", ["tp", "ep"])
def test_fused_experts_or_their_per_expert_tensors_select_the_same_elements(parallel: str) -> None:
    fused = fused_weights()
    per_expert = per_expert_weights(fused)
    layouts = {rank: WeightLayout.from_json(experts_layout(rank, parallel).to_json()) for rank in range(2)}
    assert layouts == {rank: experts_layout(rank, parallel) for rank in range(2)}  # round trip
    check_layouts(layouts, owner="test")
    gate_up, down = fused[1][1], fused[2][1]
    for rank, layout in layouts.items():
        from_fused = dict(select_weights(fused, layout, destination="rank"))
        from_experts = dict(select_weights(per_expert, layout, destination="rank"))
        assert sum(t.numel() for t in from_fused.values()) == layout.received_elements()
        assert sum(t.numel() for t in from_experts.values()) == layout.received_elements()
        # Independently of the selection code: which rows and columns of which experts.
        if parallel == "tp":
            rows = slice(rank * 3, rank * 3 + 3)
            want_gate_up = torch.cat([gate_up[:, :INTER][:, rows], gate_up[:, INTER:][:, rows]], dim=1)
            want_down = down[:, :, rows]
            for e in range(EXPERTS):
                assert torch.equal(from_experts[f"{FUSED_PREFIX}.{e}.gate_proj.weight"], gate_up[e, :INTER][rows])
                assert torch.equal(from_experts[f"{FUSED_PREFIX}.{e}.down_proj.weight"], down[e][:, rows])
        else:
            mine = slice(rank * 2, rank * 2 + 2)
            want_gate_up, want_down = gate_up[mine], down[mine]
            assert sorted(from_experts) == sorted(
                ["model.norm.weight"]
                + [
                    f"{FUSED_PREFIX}.{e}.{p}.weight"
                    for e in range(rank * 2, rank * 2 + 2)
                    for p in ("gate_proj", "up_proj", "down_proj")
                ]
            )
        assert torch.equal(from_fused[f"{FUSED_PREFIX}.gate_up_proj"], want_gate_up)
        assert torch.equal(from_fused[f"{FUSED_PREFIX}.down_proj"], want_down)
        kept = layout.find(f"{FUSED_PREFIX}.gate_up_proj")
        assert kept is not None and kept.received_shape == tuple(want_gate_up.shape)


def test_one_naming_per_group_each_complete_is_required_and_other_checks_hold() -> None:
    layout = experts_layout(0, "tp")
    fused = fused_weights()
    per_expert = per_expert_weights(fused)
    # One group fused, the other per expert: each group in one naming, accepted.
    mixed = [*fused[:2], *(item for item in per_expert if "down_proj" in item[0])]
    assert len(list(select_weights(mixed, layout, destination="rank 0"))) == 2 + EXPERTS

    def refused(weights: list[tuple[str, torch.Tensor]], message: str) -> None:
        with pytest.raises(WeightLayoutError) as caught:
            list(select_weights(weights, layout, destination="rank 0"))
        assert message in str(caught.value), caught.value

    both = [*fused, (f"{FUSED_PREFIX}.2.down_proj.weight", per_expert[9][1])]
    refused(
        both, f"yields weight '{FUSED_PREFIX}.2.down_proj.weight' and, in this refit, also '{FUSED_PREFIX}.down_proj'"
    )
    neither = [item for item in fused if "down_proj" not in item[0]]
    refused(neither, f"never yielded: '{FUSED_PREFIX}.0.down_proj.weight'")
    refused(neither, f"the other naming: '{FUSED_PREFIX}.down_proj'")
    incomplete = [item for item in per_expert if item[0] != f"{FUSED_PREFIX}.3.up_proj.weight"]
    refused(incomplete, f"names 1 weight(s) the sender never yielded: '{FUSED_PREFIX}.3.up_proj.weight'")
    reshaped = [fused[0], (fused[1][0], fused[1][1][:3]), fused[2]]
    refused(
        reshaped, f"'{FUSED_PREFIX}.gate_up_proj' has shape [3, 12, 4], but rank 0's layout was made for [4, 12, 4]"
    )
    refused([*fused, ("model.layers.0.mlp.experts.w13", fused[1][1])], "which rank 0's layout does not name")
    refused([*fused, fused[2]], f"yields weight '{FUSED_PREFIX}.down_proj' twice")


def test_a_malformed_alternative_is_refused() -> None:
    good = experts_layout(0, "tp").to_json()

    def refused(change: Any, message: str) -> None:
        data = {**good, "alternatives": change(list(good["alternatives"]))}
        with pytest.raises(WeightLayoutError) as caught:
            WeightLayout.from_json(data)
        assert message in str(caught.value), caught.value

    down = f"{FUSED_PREFIX}.down_proj"
    refused(lambda a: {"x": a}, "'alternatives' must be a list")
    refused(lambda a: [{"replaces": a[0]["replaces"]}], "exactly 'replaces' and 'weights'")
    refused(lambda a: [{**a[0], "replaces": []}], "'replaces' must be a non-empty list")
    refused(lambda a: [{**a[0], "replaces": ["nope"]}], "'replaces' names 'nope', which is not one of")
    refused(lambda a: [a[0], {**a[1], "replaces": [*a[1]["replaces"], a[0]["replaces"][0]]}], "is replaced twice")
    refused(lambda a: [a[0], {**a[1], "weights": {"model.norm.weight": a[1]["weights"][down]}}], "named elsewhere")
    refused(lambda a: [a[0], {**a[1], "replaces": a[1]["replaces"][:3]}], "hold another number of elements than the 3")
    third = {"shape": [EXPERTS, HIDDEN, INTER], "keep": {"dim": 2, "parts": [[0, 2]]}}
    refused(lambda a: [a[0], {**a[1], "weights": {down: third}}], "the two namings must keep the same part")
    refused(lambda a: [a[0], {**a[1], "weights": {down: {"shape": [4], "keep": "half"}}}], f"weight '{down}'")


def test_layouts_of_all_ranks_agree_on_alternatives_and_cover_them() -> None:
    layouts = {rank: experts_layout(rank, "tp") for rank in range(2)}
    down = f"{FUSED_PREFIX}.down_proj"
    # Rank 1 keeps columns 3..5 of each expert's down_proj, but only 3..4 of the fused one.
    short = AlternativeNaming(
        layouts[1].alternatives[1].replaces, {down: slices((EXPERTS, HIDDEN, INTER), 2, [(3, 2)])}
    )
    gap = WeightLayout(layouts[1].weights, (layouts[1].alternatives[0], short))
    with pytest.raises(WeightLayoutError, match=f"no rollout rank keeps index 5 of dimension 2 of weight '{down}'"):
        check_layouts({0: layouts[0], 1: gap}, owner="test")
    without = WeightLayout(layouts[1].weights, layouts[1].alternatives[:1])
    with pytest.raises(WeightLayoutError, match="describe different alternative namings"):
        check_layouts({0: layouts[0], 1: without}, owner="test")


def test_an_engine_sends_the_fused_naming_selected_by_the_layout() -> None:
    """A layout with alternative namings in an engine: the trainer's fused tensors pass its
    checks and arrive under their own names, bit-exact as the layout selects them."""
    layout = experts_layout(0, "tp", world_size=1)
    policy, rollout = connected(layout.to_json())
    outcome = run_refit(policy, rollout, lambda: iter(fused_weights(seed=5)))
    assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
    expected = list(select_weights(fused_weights(seed=5), layout, destination="x"))
    assert [n for n, _ in outcome.received] == [n for n, _ in expected]
    for (name, tensor), (_, want) in zip(outcome.received, expected):
        assert same_bits(tensor, want), name
    assert rollout.last_stats is not None and rollout.last_stats.payload_bytes == 4 * layout.received_elements()
    policy.finalize()
    rollout.finalize()


# --- through an engine ---------------------------------------------------------------------


def test_a_rank_receives_exactly_its_parts_bit_exact_and_its_bytes_only() -> None:
    """One rank keeping everything, but in a layout that reorders and slices: what arrives
    is each weight's selection, and the refit moves the kept bytes, not the model's."""
    shapes = moe_shapes()
    layout = tiny_moe_layout(shapes, rank=0, world_size=2)
    # Make rank 0 the only destination: keep the other half too, in a different order.
    complete = {}
    for name, kept in layout.weights.items():
        if kept.dim is not None:
            size = kept.shape[kept.dim]
            complete[name] = slices(kept.shape, kept.dim, [(size // 2, size - size // 2), (0, size // 2)])
        else:
            complete[name] = whole(kept.shape)
    policy, rollout = connected(WeightLayout(complete).to_json())
    outcome = run_refit(policy, rollout, lambda: tiny_moe(MOE, refit_index=1, rank=0))
    assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
    expected = list(select_weights(tiny_moe(MOE, refit_index=1, rank=0), WeightLayout(complete), destination="x"))
    got = outcome.received
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, tensor), (_, want) in zip(got, expected):
        assert same_bits(tensor, want), name
    # ...and independently of the selection code: the o_proj columns, second half first.
    o_proj = dict(tiny_moe(MOE, refit_index=1, rank=0))["model.layers.1.self_attn.o_proj.weight"]
    assert same_bits(
        dict(got)["model.layers.1.self_attn.o_proj.weight"], torch.cat([o_proj[:, 32:], o_proj[:, :32]], 1)
    )
    assert (
        rollout.last_stats is not None
        and rollout.last_stats.payload_bytes == 2 * WeightLayout(complete).received_elements()
    )
    policy.finalize()
    rollout.finalize()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("extra", "which rollout rank 0's layout does not name"),
        ("reshaped", "has shape [64, 32], but rollout rank 0's layout was made for [64, 64]"),
        ("missing", "names 1 weight(s) the sender never yielded: 'model.norm.weight'"),
    ],
)
def test_a_layout_of_another_model_fails_the_refit_naming_the_weight(change: str, message: str) -> None:
    shapes = moe_shapes()
    policy, rollout = connected(WeightLayout({n: whole(s) for n, s in shapes.items()}).to_json())

    def weights() -> Any:
        for name, tensor in tiny_moe(MOE, refit_index=0, rank=0):
            if change == "missing" and name == "model.norm.weight":
                continue
            if change == "reshaped" and name == "model.layers.0.self_attn.o_proj.weight":
                tensor = tensor[:, :32]
            yield name, tensor
        if change == "extra":
            yield "model.layers.9.mlp.gate.weight", torch.zeros(4, 64)

    outcome = run_refit(policy, rollout, weights)
    assert isinstance(outcome.send_error, WeightLayoutError) and message in str(outcome.send_error)
    assert isinstance(outcome.receive_error, RemoteRefitError)
    policy.finalize()
    rollout.finalize()


def test_a_bad_layout_is_refused_at_init_and_nemo_rl_layouts_pass_through() -> None:
    bad = {
        "format": LAYOUT_FORMAT,
        "version": LAYOUT_VERSION,
        "weights": {"w": {"shape": [4], "keep": {"dim": 0, "parts": [[3, 2]]}}},
    }
    with pytest.raises(WeightLayoutError, match="rollout rank 0's weight_layout: weight 'w'"):
        connected(bad)
    nemo: dict[str, Any] = {"expert_params": {}, "missing_weight_prefixes": []}  # applied by NeMo RL's own worker
    policy, rollout = connected(nemo)
    assert policy.get_target_weight_layout() == nemo
    outcome = run_refit(policy, rollout, lambda: tiny_moe(MOE, refit_index=0, rank=0))
    assert len(outcome.received) == len(moe_shapes())  # nothing selected by the engine
    policy.finalize()
    rollout.finalize()


def three_refits(
    backend: str, engine_kwargs: dict[str, Any], num_policy: int, layouts: list[WeightLayout] | None
) -> list[Any]:
    """Three refits of :func:`tiny_moe` from ``num_policy`` policy processes to 2 rollout
    processes (publishing ``layouts``), through a coordinator that checks every tensor's digest
    against what its sender's stream carried; the refit reports."""
    from ckpt_core.orchestration.coordinator import RefitCoordinator
    from ckpt_core.orchestration.local import LocalProcessPool
    from ckpt_core.orchestration.worker import refit_worker_specs

    specs, labels = refit_worker_specs(
        backend=backend,
        num_policy=num_policy,
        num_rollout=2,
        bucket_size=BUCKET,
        engine_kwargs={**engine_kwargs, "shard_expert_weights": layouts is not None},
        weights="ckpt_core.testing.weights:tiny_moe",
        weights_params=MOE,
        weight_layouts=[layout.to_json() for layout in layouts] if layouts else None,
    )
    with LocalProcessPool(specs, labels=labels) as pool:
        coordinator = RefitCoordinator(
            pool, num_policy=num_policy, num_rollout=2, timeout_s=60, topology=engine_kwargs["topology"]
        )
        coordinator.setup()
        try:
            return [coordinator.refit() for _ in range(3)]  # each raises unless every digest matches
        finally:
            coordinator.finalize()


@pytest.mark.slow
def test_paired_gloo_ranks_owning_half_the_experts_receive_their_parts_bit_exact() -> None:
    """2 policy -> 2 rollout processes over gloo_cpu (paired), each rollout rank owning half
    the experts and half of every attention matrix: three refits checked digest by digest
    against the sender's selection, and each rank's received bytes equal to its kept bytes."""
    shapes = moe_shapes()
    layouts = [tiny_moe_layout(shapes, rank, 2) for rank in range(2)]
    full_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())
    for report in three_refits("gloo_cpu", {"topology": "paired"}, 2, layouts):
        for rank, result in enumerate(report.rollout):
            kept_bytes = 2 * layouts[rank].received_elements()
            assert result["stats"]["payload_bytes"] == kept_bytes
            assert result["tensors"] == sum(k.kept for k in layouts[rank].weights.values())
            assert kept_bytes < 0.6 * full_bytes  # half the experts and attention, not the model


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
@pytest.mark.parametrize(
    ("backend", "options"), [("gloo_cpu", {}), ("cuda_ipc", {"device": "cpu"})], ids=["gloo_cpu", "cuda_ipc_cpu"]
)
def test_one_policy_rank_fans_out_each_rollout_rank_its_own_parts(
    backend: str, options: dict[str, Any], sharded: bool
) -> None:
    """1 policy -> 2 rollout processes with topology='fanout' (one trainer feeding a
    tensor-parallel-2 rollout; cuda_ipc: a pair of shared slots per rollout rank): each
    rollout rank gets a stream of its own with only its parts (or, without layouts, the whole
    model each), checked digest by digest against what its stream carried, three refits."""
    shapes = moe_shapes()
    layouts = [tiny_moe_layout(shapes, rank, 2) for rank in range(2)]
    full_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())
    for report in three_refits(backend, {**options, "topology": "fanout"}, 1, layouts if sharded else None):
        for rank, result in enumerate(report.rollout):
            expected = 2 * layouts[rank].received_elements() if sharded else full_bytes
            assert result["stats"]["payload_bytes"] == expected
        sent = report.policy[0]["stats"]["payload_bytes"]
        assert sent == sum(r["stats"]["payload_bytes"] for r in report.rollout)


@pytest.mark.parametrize("fault", ["weights_raise", "rollout_lost"])
def test_a_failed_fanout_refit_aborts_every_stream(fault: str) -> None:
    """The weights generator raising mid-refit, or one rollout rank going away: the sender
    fails with that error and every other rollout rank with the sender's abort naming it,
    never with a complete refit; no send thread outlives the call."""
    import asyncio
    import threading

    from ckpt_core.registry import create_checkpoint_engine

    big = {**MOE, "hidden": 256, "intermediate": 128}  # more than the sockets buffer
    shapes = moe_shapes(big)
    layouts = [tiny_moe_layout(shapes, rank, 2).to_json() for rank in range(2)]
    options = {"topology": "fanout", "shard_expert_weights": True, "timeout_s": 30.0}
    policy = create_checkpoint_engine("gloo_cpu", bucket_size_bytes=64 << 10, engine_kwargs=options)
    rollouts = [
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=64 << 10, engine_kwargs=options) for _ in range(2)
    ]
    metadata = [policy.prepare(), *({**r.prepare(), "weight_layout": layouts[i]} for i, r in enumerate(rollouts))]
    sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 2, "metadata": metadata}
    threads = [
        threading.Thread(target=r.init_rollout_process_group, kwargs={"rollout_rank": i, **sizes})
        for i, r in enumerate(rollouts)
    ]
    for thread in threads:
        thread.start()
    policy.init_policy_process_group(worker_rank=0, **sizes)
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    outcomes: dict[int, BaseException | None] = {}

    def receive(rank: int) -> None:
        async def run() -> None:
            async for _ in rollouts[rank].receive_weight_batches():
                if fault == "rollout_lost" and rank == 1:
                    rollouts[1].finalize()  # its connection closes under the sender
                    return

        try:
            asyncio.run(run())
            outcomes[rank] = None
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcomes[rank] = exc

    def weights() -> Any:
        for count, item in enumerate(tiny_moe(big, refit_index=0, rank=0)):
            if fault == "weights_raise" and count == 20:
                raise RuntimeError("the trainer's gather failed")
            yield item

    before = threading.active_count()
    receivers = [threading.Thread(target=receive, args=(rank,)) for rank in range(2)]
    for thread in receivers:
        thread.start()
    with pytest.raises(Exception) as sent:
        asyncio.run(policy.send_weights(weights()))
    for thread in receivers:
        thread.join(60)
        assert not thread.is_alive()
    assert threading.active_count() <= before, "a send thread outlived the refit"
    healthy = [0, 1] if fault == "weights_raise" else [0]
    cause = "the trainer's gather failed" if fault == "weights_raise" else type(sent.value).__name__
    if fault == "weights_raise":
        assert isinstance(sent.value, RuntimeError)
    for rank in healthy:
        assert isinstance(outcomes[rank], RemoteRefitError), outcomes[rank]
        assert cause in str(outcomes[rank])
    for engine in (policy, *rollouts):
        engine.finalize()
