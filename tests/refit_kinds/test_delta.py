"""Lossless deltas (ckpt_core.refit.delta): a patch applied to the old version gives the new one bit
for bit, over every kind of element, and is made only where it is fewer bytes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import ckpt_core.refit.delta as delta
from ckpt_core._internal import bitdiff
from ckpt_core.refit.delta import DeltaError, Patch, apply, apply_and_digest, compare, decode, diff, digest, patch_bytes

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


@pytest.fixture
def tiny_parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Host work cut into leaves of 64 bytes, each a part of its own where cores allow, and
    device work into chunks of 7 elements: small tensors then take the paths large ones do
    (several leaves, parts on several threads, a scratch grown mid-leaf)."""
    monkeypatch.setattr(bitdiff, "LEAF_BYTES", 64)
    monkeypatch.setattr(bitdiff, "PART_MIN_BYTES", 64)
    monkeypatch.setattr(delta, "_CHUNK_ELEMENTS", 7)
    yield


def compare_on_device_path(old: torch.Tensor, new: torch.Tensor, *, encoded: bool) -> delta.Comparison:
    """:func:`compare` as a device tensor takes it (torch's kernels), run on host tensors."""
    most = delta._most_changed(new.numel(), new.element_size(), encoded=encoded)
    return delta._compare_device(delta._bits(old, "w"), delta._bits(new, "w"), new.dtype, most, encoded, False)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "tiny parts"])
def test_the_break_even_is_bytes(chunked: bool, request: pytest.FixtureRequest) -> None:
    """bf16 with int32 positions: a patch of k elements costs 6k bytes against 2n whole, so
    one is made below n / 3 changed, not at it; the same whatever the chunking."""
    if chunked:
        request.getfixturevalue("tiny_parts")
    for _ in range(1):
        old = torch.zeros(300, dtype=torch.bfloat16)
        below, at = old.clone(), old.clone()
        below[:99] = 1
        at[:100] = 1
        patch = diff(old, below, name="w")
        assert patch is not None and patch.positions.tolist() == list(range(99))
        assert diff(old, at, name="w") is None


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("fraction", [0.05, 0.45])
def test_positions_are_found_across_leaves_parts_and_on_the_device_path(
    dtype: torch.dtype, fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tensor cut into many leaves and parts (run on several threads, their scratches
    grown past their first size) gives the patch, wire form and digest it gives whole, and
    torch's kernels (the device path) give the same patch and wire form."""
    generator = torch.Generator().manual_seed(1)
    old = random_tensor((300_000,), dtype, generator)
    new, count = changed_copy(old, fraction * min(1.0, 4 / old.element_size()) / 4, generator)
    whole = compare(old, new, name="w", encoded=True)
    device = compare_on_device_path(old, new, encoded=True)
    whole_digest = digest(new)
    monkeypatch.setattr(bitdiff, "LEAF_BYTES", 4096)
    monkeypatch.setattr(bitdiff, "PART_MIN_BYTES", 4096)
    parted = compare(old, new, name="w", encoded=True)
    for found in (whole, device, parted):
        assert found.patch is not None and found.encoded is not None and found.changed == count
        assert torch.equal(found.encoded[8:], parted.encoded[8:] if parted.encoded is not None else found.encoded)
    assert whole.digest == device.digest == whole_digest  # the digest of a whole tensor is its leaves' digest
    assert parted.digest == digest(new)  # (with the smaller leaves)
    assert whole.patch is not None and parted.patch is not None
    assert torch.equal(whole.patch.positions, parted.patch.positions)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05])
@pytest.mark.parametrize("length", [9, 8 * 1024, 300_001])
def test_a_comparison_given_the_old_digest_makes_the_new_one_from_the_changes(
    dtype: torch.dtype, fraction: float, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender that knows its copy's digest gets the new version's from the words it found
    changed (the bytes past the last whole word included), over many leaves and parts, as it
    would hash it whole; a view whose words are not its own (not 8-byte aligned) is hashed
    whole."""
    monkeypatch.setattr(bitdiff, "LEAF_BYTES", 4096)
    monkeypatch.setattr(bitdiff, "PART_MIN_BYTES", 4096)
    generator = torch.Generator().manual_seed(length)
    old = random_tensor((length,), dtype, generator)
    new, _ = changed_copy(old, fraction, generator)
    copy = old.clone()
    found = compare(copy, new, name="w", encoded=True, update=True, old_digest=digest(old))
    assert found.patch is not None and found.digest == digest(new)
    assert torch.equal(bits(copy), bits(new))
    if dtype.itemsize < 8:  # one element in: neither version's words are its own
        base, changed = old.new_empty(length + 1), new.new_empty(length + 1)
        base[1:], changed[1:] = old, new
        found = compare(base[1:], changed[1:], name="w", encoded=True, old_digest=digest(old))
        assert found.digest == digest(new)


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
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "tiny parts"])
def test_a_kept_patch_puts_back_what_the_patch_overwrote(
    dtype: torch.dtype, chunked: bool, request: pytest.FixtureRequest
) -> None:
    if chunked:
        request.getfixturevalue("tiny_parts")
    generator = torch.Generator().manual_seed(11)
    old = random_tensor((3000,), dtype, generator)
    new, _ = changed_copy(old, 0.05, generator)
    patch = diff(old, new, name="w")
    assert patch is not None and patch.changed > 0
    held = old.clone()
    undo = apply(held, patch, name="w", keep=True)
    assert undo is not None and torch.equal(bits(held), bits(new))
    apply(held, undo, name="w")
    assert torch.equal(bits(held), bits(old))
    undo, value, _, _ = apply_and_digest(held, patch, name="w")
    assert torch.equal(bits(held), bits(new)) and value == digest(new)
    apply(held, undo, name="w")
    assert torch.equal(bits(held), bits(old))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "tiny parts"])
def test_a_comparison_that_updates_patches_the_old_version_only_where_a_patch_is_made(
    dtype: torch.dtype, chunked: bool, request: pytest.FixtureRequest
) -> None:
    """``update=True`` turns the old version into the new one in the same pass, and its undo
    puts it back; where no patch is made (too many changed) the old version is untouched,
    even though the comparison had patched part of it before it knew."""
    if chunked:
        request.getfixturevalue("tiny_parts")
    generator = torch.Generator().manual_seed(12)
    old = random_tensor((5000,), dtype, generator)
    for fraction, patched in ((0.02, True), (0.9, False)):
        new, count = changed_copy(old, fraction, generator)
        held = old.clone()
        found = compare(held, new, name="w", encoded=True, update=True)
        assert (found.patch is not None) == patched
        if not patched:
            assert found.undo is None and torch.equal(bits(held), bits(old)) and found.changed > 0
            continue
        assert found.changed == count and found.undo is not None and torch.equal(bits(held), bits(new))
        apply(held, found.undo, name="w")
        assert torch.equal(bits(held), bits(old))


def test_denormals_nan_payloads_and_signed_zeros_arrive_bit_for_bit_through_the_wire_form() -> None:
    old = torch.zeros(1000, dtype=torch.float32)
    old[::7] = 1e-40  # subnormal
    old[3] = float("nan")
    new = old.clone()
    new[7] = 2e-40  # another subnormal
    new.view(torch.int32)[3] ^= 1 << 3  # another NaN payload
    new[10] = -0.0
    new.view(torch.int32)[14] ^= 1  # a subnormal's lowest bit
    found = compare(old, new, name="w", encoded=True)
    assert found.patch is not None and found.encoded is not None
    assert found.patch.positions.tolist() == [3, 7, 10, 14]
    patch, sent_digest = decode(found.encoded, old, name="w")
    held = old.clone()
    value = apply_and_digest(held, patch, name="w").digest
    assert value == sent_digest and torch.equal(bits(held), bits(new))


def test_unaligned_versions_whose_words_do_not_line_up_are_compared_element_by_element() -> None:
    """Two versions at different offsets from an eight-byte boundary cannot be compared a word
    at a time: each element is, and the patch is the same."""
    generator = torch.Generator().manual_seed(13)
    base = random_tensor((4099,), torch.bfloat16, generator)
    changed, _ = changed_copy(base, 0.03, generator)
    shifted = torch.empty(4100, dtype=torch.bfloat16)
    shifted[1:] = changed
    old, new = base[2:], shifted[3:]  # 4 and 6 bytes past their storages' (aligned) starts
    patch = diff(old, new, name="w")
    assert patch is not None
    expected = (bits(old).view(-1, 2) != bits(new).view(-1, 2)).any(1).nonzero().squeeze(1)
    assert patch.positions.tolist() == expected.tolist()


SPREAD = list(range(0, 99, 3))  # 33 positions, ascending, over every leaf of 16 elements
OUT_OF_ORDER = [
    [5, 3],
    [5, 5],
    [-1, 2],
    [4, 100],
    SPREAD[:20] + [SPREAD[19]] + SPREAD[21:],  # a repeat in the fourth leaf
    SPREAD[:11] + [29] + SPREAD[12:],  # 29 after 30
    SPREAD[:-1] + [100],  # the last out of range
]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "tiny parts"])
def test_positions_out_of_order_are_refused_and_change_nothing(chunked: bool, request: pytest.FixtureRequest) -> None:
    """Found wherever they are, in whichever leaf and part; everything written before the
    refusal, in every part, is put back."""
    if chunked:
        request.getfixturevalue("tiny_parts")
    held = torch.arange(100, dtype=torch.float32)
    kept = held.clone()
    for positions in OUT_OF_ORDER:
        patch = Patch(torch.tensor(positions, dtype=torch.int32), torch.full((len(positions),), 7.0), numel=100)
        with pytest.raises(DeltaError, match="w: the patch holds positions"):
            apply_and_digest(held, patch, name="w")
        assert torch.equal(held, kept), positions


def patch_between(old: torch.Tensor, new: torch.Tensor) -> Patch:
    """The patch of every element whose bits differ, whatever it costs."""
    width = old.element_size()
    changed = (bits(old).view(-1, width) != bits(new).view(-1, width)).any(1).nonzero().squeeze(1)
    return Patch(changed.to(torch.int32), new.reshape(-1)[changed], numel=old.numel())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("numel", [3000, 3001], ids=["whole words", "a tail"])
def test_a_digest_made_from_the_copys_terms_is_its_whole_hash_over_patches_in_a_row(
    dtype: torch.dtype, numel: int, tiny_parts: None
) -> None:
    """A receiver that knows its copy's digest terms by leaf class makes each sparse patch's
    digest from them and the words the patch writes, and hashes a denser one whole: over
    patches in a row (every fraction, many leaves in every class), the digest is the one
    hashed whole, the terms are the ones a whole hash gives, and every class audits clean."""
    generator = torch.Generator().manual_seed(21)
    old = random_tensor((numel,), dtype, generator)
    held = old.clone()
    terms = None
    for fraction in [0.001, 0.01, 0.0, 0.2, 1.0, 0.001, 0.0005]:
        new, changed = changed_copy(old, fraction, generator)
        applied = apply_and_digest(held, patch_between(old, new), name="w", terms=terms)
        assert torch.equal(bits(held), bits(new)) and applied.digest == digest(new)
        followed = terms is not None and changed * bitdiff.TERMS_BYTES_PER_ENTRY <= held.nbytes
        assert applied.terms is not None and applied.hashed is not followed
        hashed = apply_and_digest(new.clone(), patch_between(new, new), name="w").terms
        assert hashed is not None and applied.terms.tolist() == hashed.tolist()
        assert all(delta.audit(held, applied.terms, number) for number in range(delta.audit_classes(held)))
        terms, old = applied.terms, new


def test_the_audit_finds_a_write_no_patch_made_in_its_class_only(tiny_parts: None) -> None:
    """A write the terms do not know of moves the digest only where the patch reads it (its
    word): elsewhere, the audit of the class of leaves holding it finds it, and no other
    class's audit does."""
    generator = torch.Generator().manual_seed(22)
    held = random_tensor((4096,), torch.float32, generator)  # 16 KiB: 256 leaves of 64 bytes
    terms = apply_and_digest(held, patch_between(held, held), name="w").terms
    assert terms is not None and delta.audit_classes(held) == bitdiff.AUDIT_CLASSES
    held[1000] += 1  # its leaf: 4000 // 64 = 62, of class 14
    assert [n for n in range(bitdiff.AUDIT_CLASSES) if not delta.audit(held, terms, n)] == [14]
    unaligned = torch.zeros(4097, dtype=torch.uint8)[1:]  # a host copy whose words are not its own
    applied = apply_and_digest(unaligned, patch_between(unaligned, unaligned + 1), name="w")
    assert applied.terms is None and applied.digest == digest(torch.ones(4096, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32], ids=str)
def test_a_word_several_entries_write_is_followed_once(dtype: torch.dtype, tiny_parts: None) -> None:
    """Entries that share a 64-bit word (adjacent elements, as changes of one row often are)
    move its term once, from the word before the first to the word after the last: the
    digest followed from the terms is still the one hashed whole."""
    generator = torch.Generator().manual_seed(23)
    old = random_tensor((4096,), dtype, generator)
    held = old.clone()
    terms = apply_and_digest(held, patch_between(old, old), name="w").terms
    lanes = 8 // old.element_size()
    new = old.clone()
    for first in (0, 8 * lanes + 1, 700 * lanes, 4096 - lanes):  # runs of two and more inside words
        flat = bits(new).view(-1, old.element_size())
        flat[first : first + max(2, lanes - 1), 0] ^= 1
    applied = apply_and_digest(held, patch_between(old, new), name="w", terms=terms)
    assert not applied.hashed and applied.digest == digest(new) and torch.equal(bits(held), bits(new))
