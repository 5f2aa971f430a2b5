"""Runs of small tensors that a refit repeats are replayed a span at a time: checked together
and copied by one ``torch.cat`` per group. What a span cannot take is replayed one by one or
laid out afresh, and every refit stays whole, in order and bit-exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from ckpt_core._internal.host_alloc import SMALL_COPY_BYTES
from ckpt_core._internal.replay import MIN_GROUP_TENSORS, MIN_SPAN_TENSORS, SPAN_BYTES, ReplaySpan, find_spans
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import UnsupportedTensorError
from ckpt_core.testing.in_process import InProcessEngine, connected_pair, run_refit

BUCKET = 64 << 10
Weights = list[tuple[str, torch.Tensor]]


def layered(seed: int, layers: int = 6) -> Weights:
    """Per layer: five float32 norms (one group), six bfloat16 matrices of 16 columns and
    rows that vary (one group), an int64 scalar and an empty tensor (neither can join one)."""
    generator = torch.Generator().manual_seed(seed)
    out: Weights = []
    for layer in range(layers):
        out += [(f"l{layer}.norm{i}", torch.randn(32 + i, generator=generator)) for i in range(5)]
        out += [(f"l{layer}.rows{i}", torch.randn(3 + i, 16, generator=generator).to(torch.bfloat16)) for i in range(6)]
        out.append((f"l{layer}.step", torch.randint(0, 9, (), generator=generator, dtype=torch.int64)))
        out.append((f"l{layer}.empty", torch.empty(0, 4)))
    return out


def refit(policy: InProcessEngine, rollout: InProcessEngine, source: Weights) -> int:
    """One refit of ``source``, checked whole, in order and bit-exact (conjugate and negative
    views arrive resolved); returns how many tensors the sender replayed."""
    outcome = run_refit(policy, rollout, lambda: iter(source))
    assert outcome.send_error is None and outcome.receive_error is None, (outcome.send_error, outcome.receive_error)
    assert [name for name, _ in outcome.received] == [name for name, _ in source]
    for (name, got), (_, want) in zip(outcome.received, source):
        want = want.resolve_conj().resolve_neg()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert policy.last_stats is not None
    return policy.last_stats.replayed_tensors


def spans_of(policy: InProcessEngine) -> list[ReplaySpan]:
    return [span for bucket in policy._packing_record.buckets for span in bucket.spans.values()]


def metas(
    specs: Sequence[tuple[torch.dtype, Sequence[int]]], *, gap_before: int = -1, names: list[str] | None = None
) -> list[TensorMeta]:
    """Whole packed chunks laid out back to back (a gap of 64 bytes before index ``gap_before``)."""
    out, offset = [], 0
    for index, (dtype, shape) in enumerate(specs):
        offset += 64 if index == gap_before else 0
        size = torch.Size(shape).numel() * dtype.itemsize
        name = names[index] if names is not None else f"t{index}"
        out.append(TensorMeta(name, torch.Size(shape), dtype, 0, size, offset))
        offset += size
    return out


def layout(spans: dict[int, ReplaySpan]) -> list[list[tuple[int, int]]]:
    """Each span's groups, as chunk indices of the bucket."""
    return [[(span.first + lo, span.first + hi) for lo, hi, *_ in span.groups] for span in spans.values()]


F32, BF16 = torch.float32, torch.bfloat16


def test_spans_are_runs_of_groups_one_cat_can_copy() -> None:
    run = [(F32, (64,))] * 6 + [(BF16, (3, 16)), (BF16, (5, 16)), (BF16, (2, 16)), (BF16, (7, 16))]
    assert layout(find_spans(metas(run), SMALL_COPY_BYTES)) == [[(0, 6), (6, 10)]]
    # A dtype, a trailing shape or a gap ends a group; a group too small to be worth a cat
    # ends the span, and a span of too few tensors is none.
    assert layout(find_spans(metas([(F32, (64,))] * 3 + [(BF16, (8,))] * 9), SMALL_COPY_BYTES)) == [[(3, 12)]]
    assert layout(find_spans(metas([(F32, (4, 8))] * 5 + [(F32, (4, 9))] * 5), SMALL_COPY_BYTES)) == [[(0, 5), (5, 10)]]
    assert layout(find_spans(metas([(F32, (64,))] * 10, gap_before=5), SMALL_COPY_BYTES)) == [[(0, 5), (5, 10)]]
    assert find_spans(metas([(F32, (64,)), (BF16, (64,))] * 8), SMALL_COPY_BYTES) == {}
    assert find_spans(metas([(F32, (64,))] * (MIN_SPAN_TENSORS - 1)), SMALL_COPY_BYTES) == {}
    assert MIN_GROUP_TENSORS > 1
    # Scalars, empty tensors and tensors larger than small_bytes are in no group.
    mixed = [(F32, (64,))] * 8 + [(F32, ())] + [(F32, (64,))] * 8 + [(F32, (0,))] + [(F32, (64,))] * 8
    assert layout(find_spans(metas(mixed), SMALL_COPY_BYTES)) == [[(0, 8)], [(9, 17)], [(18, 26)]]
    assert layout(find_spans(metas([(F32, (64,))] * 8 + [(F32, (512,))] + [(F32, (64,))] * 8), 1024)) == [
        [(0, 8)],
        [(9, 17)],
    ]


def test_a_span_holds_at_most_span_bytes() -> None:
    per_tensor = SMALL_COPY_BYTES
    count = 2 * SPAN_BYTES // per_tensor + MIN_SPAN_TENSORS
    spans = find_spans(metas([(torch.uint8, (per_tensor,))] * count), SMALL_COPY_BYTES)
    assert len(spans) == 3 and max((s.stop - s.first) * per_tensor for s in spans.values()) <= SPAN_BYTES
    assert sum(s.stop - s.first for s in spans.values()) == count


def one_span(source: Weights) -> ReplaySpan:
    """The span of ``source``'s chunks, laid out back to back: it must cover them all."""
    chunks = metas([(t.dtype, tuple(t.shape)) for _, t in source], names=[name for name, _ in source])
    spans = find_spans(chunks, SMALL_COPY_BYTES)
    assert list(spans) == [0] and spans[0].stop == len(source)
    return spans[0]


def twelve(seed: int) -> Weights:
    generator = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(6, 6, generator=generator)) for i in range(12)]


def _shrunk(tensor: torch.Tensor) -> torch.Tensor:
    view = torch.randn(200)[100:136].view(6, 6)
    view.untyped_storage().resize_(120 * 4)  # holds less than the view reaches
    return view


class _Marked(torch.Tensor):
    pass


MISMATCHES: dict[str, Callable[[str, torch.Tensor], object]] = {
    "a name": lambda name, t: ("other", t),
    "a dtype": lambda name, t: (name, t.double()),
    "a shape": lambda name, t: (name, t.reshape(4, 9)),
    "not contiguous": lambda name, t: (name, t.t()),
    "a freed storage": lambda name, t: (name, _freed(t)),
    "a storage shrunk below its view": lambda name, t: (name, _shrunk(t)),
    "a tensor subclass": lambda name, t: (name, t.as_subclass(_Marked)),
    "a meta tensor": lambda name, t: (name, torch.empty(6, 6, device="meta")),
    "not a tensor": lambda name, t: (name, t.tolist()),
    "not a pair": lambda name, t: (name, t, 0),
}


def _freed(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.untyped_storage().resize_(0)
    return tensor


@pytest.mark.parametrize("mismatch", list(MISMATCHES), ids=list(MISMATCHES))
def test_a_span_takes_nothing_that_differs_from_its_record(mismatch: str) -> None:
    span = one_span(twelve(1))
    items: list[object] = list(twelve(2))
    assert span.repeats(items) is not None
    name, tensor = twelve(3)[5]
    items[5] = MISMATCHES[mismatch](name, tensor)
    assert span.repeats(items) is None
    assert span.repeats(list(twelve(2))[:11]) is None  # one tensor short


def test_a_span_copies_every_group_bit_exact_and_resolves_conjugate_and_negative_views() -> None:
    generator = torch.Generator().manual_seed(4)
    source: Weights = [(f"c{i}", torch.randn(5, 3, dtype=torch.complex64, generator=generator)) for i in range(6)]
    source += [(f"r{i}", torch.randn(9 + i, generator=generator)) for i in range(6)]
    span = one_span(source)
    again = [(name, tensor.conj() if i % 2 else tensor) for i, (name, tensor) in enumerate(source[:6])]
    again += [(name, torch._neg_view(tensor) if i % 2 else tensor) for i, (name, tensor) in enumerate(source[6:])]
    tensors = span.repeats(list(again))
    assert tensors is not None
    buffer = torch.zeros(sum(t.nbytes for _, t in source), dtype=torch.uint8)
    assert span.copy(tensors, buffer)
    expected = torch.cat([t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8) for _, t in again])
    assert torch.equal(buffer, expected)


def test_a_span_torch_cannot_copy_says_so_and_is_not_tried_again() -> None:
    source = twelve(5)
    span = one_span(source)
    tensors = span.repeats(list(source))
    assert tensors is not None
    misaligned = torch.zeros(12 * 36 * 4 + 1, dtype=torch.uint8)[1:]
    assert not span.copy(tensors, misaligned) and not span.copies


# Dtypes with few kernels (torch has no copy_ for the sub-byte ones; the type stubs lack them).
FEW_KERNELS = [getattr(torch, name) for name in ("uint4", "int2", "float8_e4m3fn", "bits8")]


@pytest.mark.parametrize("dtype", FEW_KERNELS, ids=str)
def test_a_span_of_a_dtype_with_few_kernels_is_copied_bit_exact(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(6)
    source = [
        (f"q{i}", torch.randint(0, 255, (64,), dtype=torch.uint8, generator=generator).view(dtype)) for i in range(12)
    ]
    span = one_span(source)
    tensors = span.repeats(list(source))
    assert tensors is not None
    buffer = torch.zeros(12 * 64, dtype=torch.uint8)
    assert span.copy(tensors, buffer)
    assert torch.equal(buffer, torch.cat([t.view(torch.uint8) for _, t in source]))


def test_refits_of_layered_weights_are_replayed_in_spans_and_stay_bit_exact() -> None:
    policy, rollout = connected_pair(BUCKET)
    assert refit(policy, rollout, layered(1)) == 0
    spans = spans_of(policy)
    assert spans and all(len(span.groups) == 2 for span in spans)  # the norms, then the rows
    for seed in (2, 3):
        assert refit(policy, rollout, layered(seed)) == len(layered(seed))
    assert all(span.copies for span in spans_of(policy))


CHANGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "a conjugate view": lambda t: t.to(torch.complex64).conj(),  # a dtype change too
    "a negative view": lambda t: torch._neg_view(t),
    "a non-contiguous tensor": lambda t: torch.randn(t.shape[::-1]).t() if t.dim() == 2 else t[None].expand(2, -1)[0],
    "another dtype": lambda t: t.double(),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_tensor_that_changes_inside_a_span_arrives_bit_exact(change: str) -> None:
    policy, rollout = connected_pair(BUCKET)
    refit(policy, rollout, layered(1))
    changed = layered(2)
    k = 13 + 2  # the third norm of layer 1, inside a span
    changed[k] = (changed[k][0], CHANGES[change](changed[k][1]))
    replayed = refit(policy, rollout, changed)
    assert replayed >= k  # every tensor before it, at least
    refit(policy, rollout, changed)
    refit(policy, rollout, layered(3))


@pytest.mark.parametrize("k", [11, 16], ids=["replayed alone", "inside a span"])
def test_a_replayed_weight_whose_storage_was_freed_is_refused_not_read(k: int) -> None:
    """FSDP frees an unsharded parameter's storage with resize_(0): a replay must not copy
    from it (one by one or in a span); the general path's check names the weight."""
    policy, rollout = connected_pair(BUCKET)
    refit(policy, rollout, layered(1))
    freed = layered(2)
    freed[k][1].untyped_storage().resize_(0)
    outcome = run_refit(policy, rollout, lambda: iter(freed))
    assert isinstance(outcome.send_error, UnsupportedTensorError)
    assert freed[k][0] in str(outcome.send_error)


def test_slots_a_cat_cannot_view_replay_tensor_by_tensor() -> None:
    policy, rollout = connected_pair(BUCKET)
    assert policy.link is not None
    policy.link.buffers = [torch.zeros(BUCKET + 1, dtype=torch.uint8)[1:] for _ in policy.link.buffers]
    refit(policy, rollout, layered(1))
    assert refit(policy, rollout, layered(2)) == len(layered(2))
    assert spans_of(policy) and not any(span.copies for span in spans_of(policy))


@pytest.mark.parametrize("dtype", FEW_KERNELS, ids=str)
def test_refits_of_dtypes_with_few_kernels_are_replayed_bit_exact(dtype: torch.dtype) -> None:
    def packed(seed: int) -> Weights:
        generator = torch.Generator().manual_seed(seed)
        return [
            (f"q{i}", torch.randint(0, 255, (128,), dtype=torch.uint8, generator=generator).view(dtype))
            for i in range(20)
        ]

    policy, rollout = connected_pair(BUCKET)
    refit(policy, rollout, packed(1))
    assert refit(policy, rollout, packed(2)) == 20
    assert refit(policy, rollout, packed(3)) == 20
