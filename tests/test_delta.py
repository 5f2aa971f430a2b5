"""Lossless deltas (ckpt_core.delta): a patch applied to the old version gives the new one bit
for bit, over every kind of element, and is made only where it is fewer bytes."""

from __future__ import annotations

import pytest
import torch

import ckpt_core.delta as delta
from ckpt_core.delta import DeltaError, Patch, apply, diff, patch_bytes, reverse

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
FRACTIONS = [0.0, 0.0001, 0.01, 0.1, 1.0]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, to compare bit for bit (NaN payloads and signed zeros included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    raw = torch.randint(
        0,
        256,
        (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=generator,
    )
    if dtype == torch.bool:
        raw = raw % 2
    numel = torch.Size(shape).numel()
    return raw.view(dtype)[:numel].reshape(shape).clone()


def changed_copy(old: torch.Tensor, fraction: float, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """``old`` with about ``fraction`` of its elements given other bits; how many changed."""
    new = old.clone()
    flat_bits = bits(new).view(-1, new.element_size())
    count = round(old.numel() * fraction)
    positions = torch.randperm(old.numel(), generator=generator)[:count]
    flat_bits[positions, 0] ^= 1  # the lowest byte's lowest bit: the smallest change there is
    return new, count


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_patch_applied_to_the_old_version_gives_the_new_one_bit_for_bit(dtype: torch.dtype, fraction: float) -> None:
    generator = torch.Generator().manual_seed(7)
    old = random_tensor((64, 300), dtype, generator)
    new, count = changed_copy(old, fraction, generator)
    patch = diff(old, new, name="w")
    cheaper = patch_bytes(count, old.numel(), old.element_size()) < old.numel() * old.element_size()
    assert (patch is not None) == cheaper
    if patch is None:
        return
    assert patch.changed == count and patch.nbytes == patch_bytes(count, old.numel(), old.element_size())
    assert bool((patch.positions[1:] > patch.positions[:-1]).all())  # ascending, each once
    target = old.clone()
    apply(target, patch, name="w")
    assert torch.equal(bits(target), bits(new))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)], ids=["0-d", "empty", "empty 3-d"])
def test_zero_dimensional_and_empty_tensors(shape: tuple[int, ...]) -> None:
    old = torch.ones(shape, dtype=torch.bfloat16)
    new = old.clone()
    same = diff(old, new, name="w")
    assert same is not None and same.changed == 0
    if old.numel():
        new.fill_(2)
        assert diff(old, new, name="w") is None  # one element of one: the whole is fewer bytes


def test_changes_are_bits_not_values() -> None:
    """Signed zeros and NaN payloads compare equal as numbers, and are changes here; the same
    NaN bits are not."""
    old = torch.tensor([0.0, float("nan"), float("nan"), 1.0] + [5.0] * 60, dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int32)[1] ^= 1  # another NaN payload
    patch = diff(old, new, name="w")
    assert patch is not None and patch.positions.tolist() == [0, 1]
    target = old.clone()
    apply(target, patch, name="w")
    assert torch.equal(bits(target), bits(new))


def test_the_break_even_is_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 with int32 positions: a patch of k elements costs 6k bytes against 2n whole, so
    one is made below n / 3 changed, not at it; the same whatever the chunking."""
    for chunk in (1 << 20, 7):
        monkeypatch.setattr(delta, "_CHUNK_ELEMENTS", chunk)
        old = torch.zeros(300, dtype=torch.bfloat16)
        below, at = old.clone(), old.clone()
        below[:99] = 1
        at[:100] = 1
        patch = diff(old, below, name="w")
        assert patch is not None and patch.positions.tolist() == list(range(99))
        assert diff(old, at, name="w") is None


def test_positions_are_found_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    old = random_tensor((1000,), torch.float32, generator)
    new, _ = changed_copy(old, 0.05, generator)
    whole = diff(old, new, name="w")
    monkeypatch.setattr(delta, "_CHUNK_ELEMENTS", 64)
    chunked = diff(old, new, name="w")
    assert whole is not None and chunked is not None
    assert torch.equal(whole.positions, chunked.positions) and torch.equal(bits(whole.values), bits(chunked.values))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 23, 64, 67])
def test_positions_are_every_differing_element_at_any_alignment_and_length(
    dtype: torch.dtype, offset: int, length: int
) -> None:
    """Narrow elements are compared a word at a time where the memory allows: storage offsets
    that are not word-aligned, and lengths that leave a tail after the last whole word, find
    the same positions as comparing element by element."""
    generator = torch.Generator().manual_seed(length * 10 + offset)
    base = random_tensor((offset + length,), dtype, generator)
    changed, _ = changed_copy(base, 0.15, generator)
    old, new = base[offset:], changed[offset:]  # views starting `offset` elements in
    patch = diff(old, new, name="w")
    expected = (bits(old).view(-1, old.element_size()) != bits(new).view(-1, new.element_size())).any(1)
    if patch is None:
        assert int(expected.sum()) * patch_bytes(1, length, old.element_size()) >= old.nbytes
    else:
        assert patch.positions.tolist() == expected.nonzero().squeeze(1).tolist()
        patched = old.clone()
        apply(patched, patch, name="w")
        assert torch.equal(bits(patched), bits(new))


def test_a_non_contiguous_version_is_compared_by_its_elements() -> None:
    old = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    new = old.clone()
    new[2, 5] = -1
    patch = diff(old.t(), new.t(), name="w")
    assert patch is not None and patch.positions.tolist() == [5 * 8 + 2]


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (torch.zeros(4, 4), torch.zeros(16), r"w: no patch relates torch.float32 \[4, 4\]"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float64), "no patch relates torch.float32"),
    ],
    ids=["shape", "dtype"],
)
def test_versions_no_patch_relates_are_refused(old: torch.Tensor, new: torch.Tensor, said: str) -> None:
    with pytest.raises(DeltaError, match=said):
        diff(old, new, name="w")


def test_a_patch_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    target = torch.zeros(10)
    values = torch.ones(1)
    for patch, said in [
        (Patch(torch.tensor([3], dtype=torch.int32), values, numel=11), "a patch for 11 elements"),
        (Patch(torch.tensor([3], dtype=torch.int32), values.double(), numel=10), "of torch.float64 cannot"),
        (Patch(torch.tensor([10], dtype=torch.int32), values, numel=10), "positions outside its 10 elements"),
    ]:
        with pytest.raises(DeltaError, match=said):
            apply(target, patch, name="w")
    assert not bool(target.any())
    with pytest.raises(DeltaError, match="contiguous"):
        apply(torch.zeros(4, 4).t(), Patch(torch.tensor([0], dtype=torch.int32), values, numel=16), name="w")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64], ids=str)
def test_a_reversed_patch_puts_back_what_the_patch_overwrote(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(11)
    old = random_tensor((300,), dtype, generator)
    new, _ = changed_copy(old, 0.05, generator)
    patch = diff(old, new, name="w")
    assert patch is not None and patch.changed > 0
    held = old.clone()
    undo = reverse(held, patch, name="w")
    apply(held, patch, name="w")
    assert torch.equal(bits(held), bits(new))
    apply(held, undo, name="w")
    assert torch.equal(bits(held), bits(old))
