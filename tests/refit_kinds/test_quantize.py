"""Quantize-on-send (``ckpt_core.refit.quantize``): a rollout's ``"weight_quantization"`` parsed and
checked, the stage on its own (each named weight cast to the rollout's dtype and sent as FP8
bytes followed by its scale; everything else untouched; nothing named left unsent), and the
stage in an engine (``quantize_for_rollout``): what the rollout receives is bit for bit
``ckpt_core.refit.quantize.fp8.quantize`` of the weight as the rollout holds it, with a layout slicing
weights and scales alike, and a missing or mismatched setting refused at init."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt_core.errors import EngineOptionError, InvalidArgumentError, RemoteRefitError
from ckpt_core.refit.layout import WeightLayout, slices, whole
from ckpt_core.refit.quantize import SPEC_FORMAT, SPEC_VERSION, QuantizationSpec, quantize_weights
from ckpt_core.refit.quantize.fp8 import Fp8Format, QuantizationError, quantize
from ckpt_core.testing.in_process import InProcessEngine, run_refit

BUCKET = 64 << 10
QUANTIZED = ["layers.0.q_proj.weight", "layers.0.down_proj.weight"]


def spec_json(fmt: str = "per_channel", **changes: Any) -> dict[str, Any]:
    return {
        "format": SPEC_FORMAT,
        "version": SPEC_VERSION,
        "dtype": "bfloat16",
        "fp8": fmt,
        "weights": QUANTIZED,
        **changes,
    }


def trainer_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """float32 masters, as a trainer holds them."""
    generator = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(64, 32, generator=generator)),
        ("layers.0.q_proj.weight", torch.randn(256, 160, generator=generator)),
        ("layers.0.norm.weight", torch.randn(32, generator=generator)),
        ("layers.0.down_proj.weight", torch.randn(96, 256, generator=generator) * 0.02),
    ]


def weights_of(seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(trainer_weights(seed))


def expected(weights: list[tuple[str, torch.Tensor]], fmt: Fp8Format) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, tensor in weights:
        if name in QUANTIZED:
            q = quantize(name, tensor.to(torch.bfloat16), fmt)  # the rollout loads bf16, then quantizes
            out += [(name, q.weight), (q.scale_name, q.scale)]
        else:
            out.append((name, tensor))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def test_a_spec_round_trips() -> None:
    spec = QuantizationSpec.from_json(spec_json("block"), owner="rollout")
    assert spec.fmt is Fp8Format.BLOCK and spec.dtype == torch.bfloat16 and spec.weights == frozenset(QUANTIZED)
    assert QuantizationSpec.from_json(spec.to_json(), owner="rollout") == spec


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"format": "something"}, "expected format 'ckpt-engine.weight-quantization' version 1"),
        ({"version": 2}, "version 1, got 'ckpt-engine.weight-quantization' version 2"),
        ({"dtype": "float8"}, "'dtype' must be one of"),
        ({"fp8": "per_row"}, "'fp8' must be one of \\['per_channel', 'per_tensor', 'block'\\]"),
        ({"weights": []}, "'weights' must be a non-empty list"),
        ({"weights": ["a.weight", "a.weight"]}, "names a weight twice"),
        ({"weights": ["a.bias"]}, "only a module's `weight` is quantized"),
        ({"extra": 1}, "unknown keys \\['extra'\\]"),
    ],
)
def test_a_malformed_spec_is_refused(changes: dict[str, Any], said: str) -> None:
    with pytest.raises(QuantizationError, match=f"rollout rank 1: .*{said}"):
        QuantizationSpec.from_json(spec_json(**changes), owner="rollout rank 1")


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_the_stage_quantizes_what_the_rollout_names_and_passes_the_rest(fmt: Fp8Format) -> None:
    spec = QuantizationSpec.from_json(spec_json(fmt.value), owner="rollout")
    weights = trainer_weights()
    sent = list(quantize_weights(iter(weights), spec, destination="rollout rank 0"))
    want = expected(weights, fmt)
    assert [name for name, _ in sent] == [name for name, _ in want]
    for (name, tensor), (_, other) in zip(sent, want):
        assert same_bits(tensor, other), name
    assert sent[0][1] is weights[0][1]  # untouched weights are the caller's own tensors


def test_the_stage_refuses_a_scale_from_the_sender_and_a_weight_never_sent() -> None:
    spec = QuantizationSpec.from_json(spec_json(), owner="rollout")
    weights = trainer_weights()
    with pytest.raises(QuantizationError, match="yielded 'layers.0.q_proj.weight_scale', the scale of"):
        list(
            quantize_weights(
                iter([*weights, ("layers.0.q_proj.weight_scale", torch.ones(256, 1))]), spec, destination="r"
            )
        )
    without = [pair for pair in weights if pair[0] != "layers.0.down_proj.weight"]
    never = r"rollout rank 3: holds 1 weight\(s\) quantized that the sender never yielded \(layers.0.down_proj.weight\)"
    with pytest.raises(QuantizationError, match=never):
        list(quantize_weights(iter(without), spec, destination="rollout rank 3"))


def connected(rollout_extra: dict[str, Any], **options: Any) -> tuple[InProcessEngine, InProcessEngine]:
    policy = InProcessEngine(bucket_size=BUCKET, **options)
    rollout = InProcessEngine(bucket_size=BUCKET, **options)
    metadata = [policy.prepare(), {**rollout.prepare(), **rollout_extra}]
    policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    return policy, rollout


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_an_engine_sends_what_the_rollout_would_compute(fmt: Fp8Format) -> None:
    policy, rollout = connected({"weight_quantization": spec_json(fmt.value)}, quantize_for_rollout=True)
    for refit in range(2):
        outcome = run_refit(policy, rollout, functools.partial(weights_of, refit))
        assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
        want = expected(trainer_weights(seed=refit), fmt)
        assert [name for name, _ in outcome.received] == [name for name, _ in want]
        for (name, tensor), (_, other) in zip(outcome.received, want):
            assert same_bits(tensor, other), f"refit {refit}: {name}"
    policy.finalize()
    rollout.finalize()


def test_a_layout_slices_scales_with_their_weights() -> None:
    """Per-channel scales follow the rows a rank keeps: a layout that keeps rows of a weight
    (here both halves, swapped) keeps the same rows of its scale."""
    shapes = {name: tuple(tensor.shape) for name, tensor in trainer_weights()}
    entries = {name: whole(shape) for name, shape in shapes.items() if name not in QUANTIZED}
    swapped: dict[str, list[tuple[int, int]]] = {}
    for name in QUANTIZED:
        rows = shapes[name][0]
        swapped[name] = swapped[f"{name}_scale"] = [(rows // 2, rows - rows // 2), (0, rows // 2)]
        entries[name] = slices(shapes[name], 0, swapped[name])
        entries[f"{name}_scale"] = slices((rows, 1), 0, swapped[name])
    policy, rollout = connected(
        {"weight_quantization": spec_json(), "weight_layout": WeightLayout(entries).to_json()},
        quantize_for_rollout=True,
        shard_expert_weights=True,
    )
    outcome = run_refit(policy, rollout, lambda: iter(trainer_weights()))
    assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
    received = dict(outcome.received)
    for name, tensor in expected(trainer_weights(), Fp8Format.PER_CHANNEL):
        want = (
            torch.cat([tensor[offset : offset + length] for offset, length in swapped[name]])
            if name in swapped
            else tensor
        )
        assert same_bits(received[name], want), name
    policy.finalize()
    rollout.finalize()


def test_init_refuses_a_rollout_without_a_spec_and_a_mismatched_setting() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match="quantize_for_rollout=True, but rollout rank 0's prepare\\(\\) metadata has no 'weight_quantization'",
    ):
        connected({}, quantize_for_rollout=True)
    policy = InProcessEngine(bucket_size=BUCKET, quantize_for_rollout=True)
    rollout = InProcessEngine(bucket_size=BUCKET)  # the rollout expects full-precision weights
    metadata = [policy.prepare(), {**rollout.prepare(), "weight_quantization": spec_json()}]
    with pytest.raises(EngineOptionError, match="quantize_for_rollout"):
        policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)


def test_a_weight_the_rollout_holds_quantized_but_never_sent_fails_the_refit() -> None:
    policy, rollout = connected({"weight_quantization": spec_json()}, quantize_for_rollout=True)
    weights = [pair for pair in trainer_weights() if pair[0] != "layers.0.down_proj.weight"]
    outcome = run_refit(policy, rollout, lambda: iter(weights))
    assert isinstance(outcome.send_error, QuantizationError), outcome.send_error
    assert "never yielded (layers.0.down_proj.weight)" in str(outcome.send_error)
    assert isinstance(outcome.receive_error, RemoteRefitError), outcome.receive_error
