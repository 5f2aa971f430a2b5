"""Lossless deltas between two versions of a tensor: the elements whose bits changed.

The building block of delta refits (:mod:`ckpt_core.refit.delta.baselines`): a sender that knows what a
destination last committed sends, for each tensor, either a :class:`Patch` (the flat positions
of the changed elements and their new values) or the whole tensor, whichever is fewer bytes;
the destination applies the patch to its copy and holds the new tensor, bit for bit.

Changes are found bitwise, never by a tolerance: both versions are viewed as integers of their
element's width, so ``-0.0`` against ``0.0``, one NaN payload against another and a subnormal
that moved are changes, and every dtype whose elements are whole bytes works the same way (the
floats, FP8, integers, ``bool``). A 0-d tensor is one element; a tensor with no elements has
an empty patch.

A patch costs ``changed x (value bytes + position bytes)``, positions as ``int32`` (``int64``
for tensors of 2**31 elements or more); :func:`diff` returns ``None`` when that is not fewer
bytes than the whole tensor.

**Speed.** Host tensors are compared, patched and digested by compiled loops that read each
byte once, over every usable core (:mod:`ckpt_core._internal.bitdiff`): a diff runs near the
memory's read speed, a patch costs in proportion to its changed elements. Device tensors use
torch's own kernels on their device, ``_CHUNK_ELEMENTS`` at a time (bounding the temporaries).

**Wire form.** :func:`compare` with ``encoded=True`` lays a patch out as one ``uint8`` tensor
(what a delta refit sends; :func:`decode`): the new version's :func:`digest` (8 bytes,
little-endian), the positions, zeros up to a multiple of 8 bytes, the values.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from ckpt_core._internal import bitdiff
from ckpt_core._internal.device_checksum import device_payload_checksum
from ckpt_core._internal.host_alloc import empty_host
from ckpt_core.errors import InvalidArgumentError, WireFormatError

# Device tensors: elements compared at once (bounds the comparison's mask, 16 MiB).
__all__ = [
    "Applied",
    "Comparison",
    "DIGEST_BYTES",
    "DeltaError",
    "Patch",
    "SCREEN_PARTS",
    "apply",
    "apply_and_digest",
    "audit",
    "audit_classes",
    "can_pay",
    "compare",
    "copy_bits",
    "decode",
    "diff",
    "digest",
    "encoded_bytes",
    "fits_sample",
    "most_changed",
    "patch_bytes",
    "patchable",
    "position_dtype",
    "sample_changes",
    "sample_ranges",
    "take_sample",
]

_CHUNK_ELEMENTS = 16 << 20
_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST = struct.Struct("<Q")
DIGEST_BYTES = _DIGEST.size
"""The digest that opens a patch's wire form."""


class DeltaError(InvalidArgumentError):
    """Two versions that no patch relates (another shape or dtype, a tensor on another device,
    an element type that is not whole bytes), or a patch that does not fit the tensor it is
    applied to. The message names the tensor."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """The elements of a tensor that changed: ``positions`` (ascending flat indices, ``int32``
    or ``int64``) and their new ``values`` (1-D, the tensor's dtype), for a tensor of
    ``numel`` elements. Both may be views of one buffer (a patch's wire form)."""

    positions: torch.Tensor
    values: torch.Tensor
    numel: int

    @property
    def changed(self) -> int:
        return int(self.positions.numel())

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: positions and values."""
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What :func:`compare` found: the ``patch`` (``None``: the whole tensor is no more
    bytes), the ``changed`` elements among the ``compared`` ones (all of them with a patch;
    without one, the comparison may stop early, once a patch cannot pay); with ``encoded=True`` and a patch, its
    wire form ``encoded`` (the patch's tensors view it) and the new version's ``digest``; with
    ``update=True`` and a patch, the patch that puts the old version back (``undo``)."""

    patch: Patch | None
    changed: int
    compared: int
    encoded: torch.Tensor | None = None
    digest: int | None = None
    undo: Patch | None = None


def position_dtype(numel: int) -> torch.dtype:
    """The dtype of a patch's positions for a tensor of ``numel`` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def patch_bytes(changed: int, numel: int, element_size: int) -> int:
    """What a patch of ``changed`` elements of a tensor of ``numel`` costs on the wire."""
    return changed * (element_size + (4 if position_dtype(numel) == torch.int32 else 8))


def encoded_bytes(changed: int, numel: int, element_size: int) -> int:
    """The size of the wire form of a patch of ``changed`` elements (:func:`compare`)."""
    return bitdiff.layout(changed, DIGEST_BYTES, position_dtype(numel).itemsize, element_size)[1]


def diff(old: torch.Tensor, new: torch.Tensor, *, name: str) -> Patch | None:
    """The patch that turns ``old`` into ``new`` bit for bit, or ``None`` when sending ``new``
    whole is no more bytes. ``name`` names the tensor in a :class:`DeltaError` (the two differ
    in shape, dtype or device, or their elements are not whole bytes)."""
    return compare(old, new, name=name).patch


def compare(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    name: str,
    encoded: bool = False,
    update: bool = False,
    screen: bool = False,
    old_digest: int | None = None,
) -> Comparison:
    """Compare two versions of a tensor (see :func:`diff`, which this generalises). With
    ``encoded``, the patch is made in its wire form, with the new version's digest, and
    only where that form (digest and padding included) is fewer bytes than ``new``; given
    ``old_digest`` (``old``'s :func:`digest`), a host comparison makes the new version's
    from the words that changed, without hashing the rest. With
    ``update`` (``old`` contiguous), ``old`` is patched into ``new`` in the same pass where a
    patch is made (``Comparison.undo`` puts it back), and left as it was where none is.

    With ``screen`` (for a tensor whose changed fraction is unknown, or may be near the
    break-even), the elements that changed are first counted in a sixteenth of the tensor,
    spread over it (:data:`SCREEN_PARTS` ranges): where that many would not pay, it stops
    there, without a patch (``changed`` and ``compared`` are the sample's). A comparison past
    the break-even otherwise lays out patch entries until it knows, which at a high changed
    fraction costs several times a pass that only reads."""
    bits_old, bits_new = _bits(old, name), _bits(new, name)
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        raise DeltaError(
            f"{name}: no patch relates {old.dtype} {list(old.shape)} on {old.device} to {new.dtype} "
            f"{list(new.shape)} on {new.device}: send it whole"
        )
    if update and not old.is_contiguous():
        raise DeltaError(f"{name}: a version updated in place must be contiguous")
    max_changed = _most_changed(new.numel(), new.element_size(), encoded=encoded)
    if screen and max_changed >= 0:
        changed, compared = _sample(bits_old, bits_new)
        if changed * new.numel() > max_changed * compared:
            return Comparison(patch=None, changed=changed, compared=compared)
    if new.device.type == "cpu":
        return _compare_host(bits_old, bits_new, new.dtype, max_changed, encoded, update, old_digest)
    return _compare_device(bits_old, bits_new, new.dtype, max_changed, encoded, update)


SCREEN_PARTS = 16
"""The ranges a screening comparison counts, spread evenly over the tensor: a sixteenth of it."""
_SCREEN_ALL_BELOW = 1 << 16  # elements: a smaller tensor is screened whole


def sample_ranges(numel: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges a screening comparison reads in a tensor of
    ``numel`` elements: :data:`SCREEN_PARTS` ranges of ``numel / SCREEN_PARTS**2`` elements,
    evenly spread (the whole tensor, below 65536 elements). All have one length."""
    if numel < _SCREEN_ALL_BELOW:
        return [(0, numel)]
    length = numel // SCREEN_PARTS**2
    return [(part * numel // SCREEN_PARTS, part * numel // SCREEN_PARTS + length) for part in range(SCREEN_PARTS)]


def _sample_starts(numel: int) -> tuple[np.ndarray, int]:
    """:func:`sample_ranges` as ``(starts, length)``."""
    ranges = sample_ranges(numel)
    return np.array([start for start, _ in ranges], dtype=np.int64), ranges[0][1] - ranges[0][0]


def take_sample(tensor: torch.Tensor, *, name: str) -> torch.Tensor:
    """A copy of ``tensor``'s screening ranges (:func:`sample_ranges`), as integers of its
    elements' width, one after the other: what :func:`sample_changes` compares it with later."""
    bits = _bits(tensor, name)
    return torch.cat([bits[start:stop] for start, stop in sample_ranges(bits.numel())])


def fits_sample(sample: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``sample`` (:func:`take_sample`) could be of a version of ``tensor``: the same
    element width, device and count of sampled elements."""
    ranges = sample_ranges(tensor.numel())
    return (
        patchable(tensor)
        and sample.element_size() == tensor.element_size()
        and sample.device == tensor.device
        and sample.numel() == sum(stop - start for start, stop in ranges)
    )


def sample_changes(sample: torch.Tensor, tensor: torch.Tensor, *, name: str) -> tuple[int, int]:
    """``(changed, compared)``: the elements of ``tensor``'s screening ranges whose bits differ
    from ``sample`` (made by :func:`take_sample` from an earlier version of it), which is then
    refreshed to this version in place. A :class:`DeltaError` names ``name`` for a sample that
    does not fit the tensor (:func:`fits_sample`)."""
    if not fits_sample(sample, tensor):
        raise DeltaError(
            f"{name}: a sample of {sample.numel()} {sample.dtype} does not fit {tensor.dtype} {list(tensor.shape)}"
        )
    bits = _bits(tensor, name)
    if bits.device.type == "cpu":
        starts, length = _sample_starts(bits.numel())
        return bitdiff.count_and_refresh(sample.numpy(), bits.numpy(), starts, length), sample.numel()
    changed, at = 0, 0
    for start, stop in sample_ranges(bits.numel()):
        held, now = sample[at : at + stop - start], bits[start:stop]
        changed += int((held != now).sum())
        held.copy_(now)
        at += stop - start
    return changed, at


def _sample(old: torch.Tensor, new: torch.Tensor) -> tuple[int, int]:
    """``(changed, compared)`` over the screening ranges of two versions (integer views)."""
    ranges = sample_ranges(new.numel())
    compared = sum(stop - start for start, stop in ranges)
    if new.device.type == "cpu":
        starts, length = _sample_starts(new.numel())
        return bitdiff.count(old.numpy(), new.numpy(), starts, length), compared
    return sum(int((old[start:stop] != new[start:stop]).sum()) for start, stop in ranges), compared


def most_changed(tensor: torch.Tensor) -> int:
    """The most changed elements a patch of ``tensor`` in its wire form (:func:`compare` with
    ``encoded``) may hold and still be fewer bytes than the tensor; -1 where not even an empty
    one is (see :func:`can_pay`)."""
    return _most_changed(tensor.numel(), tensor.element_size(), encoded=True) if patchable(tensor) else -1


@functools.lru_cache(maxsize=1024)  # asked of every weight at every refit, several times; shapes repeat
def _most_changed(numel: int, width: int, *, encoded: bool) -> int:
    """The most changed elements a patch (or its wire form) may hold and still be fewer bytes
    than the whole tensor; -1 where none may, not even an empty one. (A tensor of no elements
    has an empty patch, but no wire form smaller than it.)"""
    budget = numel * width
    per_element = patch_bytes(1, numel, width)
    if not encoded:
        return (budget - 1) // per_element if numel else 0
    count = (budget - DIGEST_BYTES - 1) // per_element  # an upper bound: the padding is not counted
    while count >= 0 and encoded_bytes(count, numel, width) >= budget:
        count -= 1
    return max(count, -1)


def _compare_host(
    old: torch.Tensor,
    new: torch.Tensor,
    dtype: torch.dtype,
    max_changed: int,
    encoded: bool,
    update: bool,
    old_digest: int | None,
) -> Comparison:
    numel = new.numel()
    positions_dtype = position_dtype(numel)
    if max_changed < 0:
        return Comparison(patch=None, changed=0, compared=0)
    found = bitdiff.find(
        old.numpy(),
        new.numpy(),
        max_changed=max_changed,
        position_dtype=_numpy_dtype(positions_dtype),
        prefix=DIGEST_BYTES if encoded else 0,
        with_digest=encoded,
        update=update,
        old_digest=old_digest,
    )
    if found.over:
        return Comparison(patch=None, changed=found.count, compared=found.compared)
    assert found.blob is not None
    blob = torch.from_numpy(found.blob)
    if encoded:
        assert found.digest is not None
        blob[:DIGEST_BYTES] = torch.frombuffer(bytearray(_DIGEST.pack(found.digest)), dtype=torch.uint8)
    patch = _views(blob, found.count, numel, dtype, prefix=DIGEST_BYTES if encoded else 0)
    undo = None
    if found.saved is not None:
        undo = Patch(patch.positions, _typed(torch.from_numpy(found.saved), dtype), numel)
    return Comparison(
        patch=patch,
        changed=found.count,
        compared=numel,
        encoded=blob if encoded else None,
        digest=found.digest,
        undo=undo,
    )


def _compare_device(
    old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype, max_changed: int, encoded: bool, update: bool
) -> Comparison:
    """The comparison with torch's kernels on the tensors' device, ``_CHUNK_ELEMENTS`` at a time."""
    numel = new.numel()
    if max_changed < 0:
        return Comparison(patch=None, changed=0, compared=0)
    found: list[torch.Tensor] = []
    changed = 0
    for start in range(0, numel, _CHUNK_ELEMENTS):
        length = min(_CHUNK_ELEMENTS, numel - start)
        positions = _changed(old.narrow(0, start, length), new.narrow(0, start, length))
        changed += positions.numel()
        if changed > max_changed:
            return Comparison(patch=None, changed=changed, compared=start + length)
        if positions.numel():
            found.append(positions.add_(start))
    positions = torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=new.device)
    values = new.index_select(0, positions)
    patch = Patch(positions=positions.to(position_dtype(numel)), values=_typed(values, dtype), numel=numel)
    undo = None
    if update:
        undo = Patch(patch.positions, _typed(old.index_select(0, positions), dtype), numel)
        old.index_copy_(0, positions, values)
    if not encoded:
        return Comparison(patch=patch, changed=changed, compared=numel, undo=undo)
    digest_value = digest(new)
    blob = _encode(digest_value, patch)
    views = _views(blob, changed, numel, dtype, prefix=DIGEST_BYTES)
    return Comparison(patch=views, changed=changed, compared=numel, encoded=blob, digest=digest_value, undo=undo)


def _changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The ascending indices (``int64``) where two flat integer tensors differ. Narrow
    elements are compared eight bytes at a time first, then only the words that differ
    lane by lane: the comparison's mask, and the scan for its set entries, shrink by the
    elements per word."""
    lanes = 8 // old.element_size()
    words = old.numel() // lanes
    if lanes == 1 or words == 0 or not (_word_view(old, words) and _word_view(new, words)):
        return (old != new).nonzero().squeeze(1)
    old_words = old.narrow(0, 0, words * lanes).view(torch.int64)
    new_words = new.narrow(0, 0, words * lanes).view(torch.int64)
    differing = (old_words != new_words).nonzero().squeeze(1)
    word, lane = (
        old_words.index_select(0, differing).view(old.dtype).view(-1, lanes)
        != new_words.index_select(0, differing).view(new.dtype).view(-1, lanes)
    ).nonzero(as_tuple=True)
    positions = differing.index_select(0, word).mul_(lanes).add_(lane)
    tail = words * lanes
    if tail == old.numel():
        return positions
    rest = (old.narrow(0, tail, old.numel() - tail) != new.narrow(0, tail, new.numel() - tail)).nonzero().squeeze(1)
    return torch.cat([positions, rest.add_(tail)])


def _word_view(flat: torch.Tensor, words: int) -> bool:
    """Whether ``flat``'s first ``words`` eight-byte words can be viewed as ``int64`` (its
    storage offset aligned to eight bytes)."""
    return (flat.storage_offset() * flat.element_size()) % 8 == 0 and words > 0


def apply(tensor: torch.Tensor, patch: Patch, *, name: str, keep: bool = False) -> Patch | None:
    """Write ``patch``'s values into ``tensor`` (the old version, contiguous) in place; with
    ``keep``, return the patch that undoes it (the same positions, with the values they held).
    A :class:`DeltaError` names ``name`` if the patch was made for another size or dtype, or
    holds a position out of range or out of order; ``tensor`` is then as it was (with
    ``keep``; without it, positions are trusted as made by :func:`compare`)."""
    return _apply(tensor, patch, name, keep=keep, with_digest=False)[0]


class Applied(NamedTuple):
    """What :func:`apply_and_digest` did: the patch that undoes it (``undo``); the patched tensor's
    ``digest``; for a host tensor whose words are its own (8-byte aligned), its digest
    ``terms`` by leaf class (else ``None``); and whether it was ``hashed`` whole (every byte
    read) rather than followed from the terms given."""

    undo: Patch
    digest: int
    terms: np.ndarray | None
    hashed: bool


def apply_and_digest(tensor: torch.Tensor, patch: Patch, *, name: str, terms: np.ndarray | None = None) -> Applied:
    """:func:`apply` with ``keep``, and the :func:`digest` of ``tensor`` once patched. Given
    ``terms`` (``tensor``'s, as this returned them after the patch before, nothing else having
    written to it since) and a sparse patch (:data:`~ckpt_core._internal.bitdiff.TERMS_BYTES_PER_ENTRY`),
    the digest is made from them and the words the patch writes, in time that follows the
    patch; else ``tensor`` is hashed whole as it is patched. :func:`audit` reads what the first
    way does not."""
    undo, value, after, hashed = _apply(tensor, patch, name, keep=True, with_digest=True, terms=terms)
    assert undo is not None and value is not None
    return Applied(undo, value, after, hashed)


def audit(tensor: torch.Tensor, terms: np.ndarray, number: int) -> bool:
    """Whether class ``number`` of ``tensor``'s leaves (a host tensor's; of
    :func:`audit_classes`) still hashes to its sum in ``terms`` (made by
    :func:`apply_and_digest`): ``False`` where something other than patches wrote there."""
    held = _bits(tensor, "audited").numpy()
    return bitdiff.class_terms(held, number) == int(terms[number])


def audit_classes(tensor: torch.Tensor) -> int:
    """How many classes of leaves :func:`audit` reads ``tensor`` in, one per patch: at most
    :data:`~ckpt_core._internal.bitdiff.AUDIT_CLASSES` (a tensor of fewer leaves, fewer)."""
    return bitdiff.audit_classes(_bits(tensor, "audited").numpy())


def _apply(
    tensor: torch.Tensor,
    patch: Patch,
    name: str,
    *,
    keep: bool,
    with_digest: bool,
    terms: np.ndarray | None = None,
) -> tuple[Patch | None, int | None, np.ndarray | None, bool]:
    """The undo patch (with ``keep``), the digest, the terms and whether hashed whole (as
    :class:`Applied` has them; the first two ``None`` where not asked for)."""
    if patch.numel != tensor.numel() or patch.values.dtype != tensor.dtype:
        raise DeltaError(
            f"{name}: a patch for {patch.numel} elements of {patch.values.dtype} cannot apply to "
            f"{tensor.numel()} elements of {tensor.dtype}"
        )
    if not tensor.is_contiguous():
        raise DeltaError(f"{name}: a patch applies to a contiguous tensor, in place")
    held, values = _bits(tensor, name), _bits(patch.values.to(tensor.device), name)
    if tensor.device.type == "cpu":
        try:
            done = bitdiff.patch(
                held.numpy(),
                patch.positions.numpy(),
                values.numpy(),
                keep=keep,
                with_digest=with_digest,
                terms=terms,
            )
        except ValueError as exc:
            raise DeltaError(
                f"{name}: the patch holds positions outside its {tensor.numel()} elements ({exc})"
            ) from None
        undo = (
            None
            if done.saved is None
            else Patch(patch.positions, _typed(torch.from_numpy(done.saved), tensor.dtype), patch.numel)
        )
        return undo, done.digest, done.terms, done.hashed
    positions = patch.positions.long()
    if patch.changed and (
        int(positions.min()) < 0
        or int(positions.max()) >= tensor.numel()
        or (patch.changed > 1 and not bool((positions[1:] > positions[:-1]).all()))
    ):
        raise DeltaError(f"{name}: the patch holds positions outside its {tensor.numel()} elements, or out of order")
    undo = None
    if keep:
        undo = Patch(patch.positions, _typed(held.index_select(0, positions), tensor.dtype), patch.numel)
    held.index_copy_(0, positions, values)  # as integers of the same width: bit for bit, FP8 included
    return undo, digest(tensor) if with_digest else None, None, with_digest


def digest(tensor: torch.Tensor) -> int:
    """A 64-bit digest of ``tensor``'s bytes, what a patched weight is checked against: the
    word digest (:mod:`ckpt_core._internal.bitdiff`) on the host, ckpt-engine's device digest
    elsewhere."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    return bitdiff.digest(data.numpy()) if data.device.type == "cpu" else device_payload_checksum(data)


def decode(encoded: torch.Tensor, like: torch.Tensor, *, name: str) -> tuple[Patch, int]:
    """The patch (and the sender's digest of the new version) in a wire form made by
    :func:`compare`, for a tensor like ``like``; its tensors view ``encoded`` where its memory
    allows (host memory, aligned), else copies. ``WireFormatError`` for a size that is no
    patch's."""
    numel, width = like.numel(), like.element_size()
    positions_dtype = position_dtype(numel)
    position_width = torch.empty((), dtype=positions_dtype).element_size()
    estimate = (encoded.numel() - DIGEST_BYTES) // (position_width + width)  # the padding may add one
    count = next(
        (c for c in (estimate, estimate - 1) if c >= 0 and encoded_bytes(c, numel, width) == encoded.numel()), -1
    )
    if encoded.dtype != torch.uint8 or encoded.dim() != 1 or count < 0:
        raise WireFormatError(
            f"{name}: a patch of {encoded.numel()} bytes does not hold whole elements of {like.dtype} with their "
            "positions"
        )
    (value,) = _DIGEST.unpack(encoded[:DIGEST_BYTES].cpu().numpy().tobytes())
    data = encoded.to(like.device)
    if data.data_ptr() % 8:
        data = data.clone()  # a fresh allocation is aligned for any element
    return _views(data, count, numel, like.dtype, prefix=DIGEST_BYTES), value


def _encode(digest_value: int, patch: Patch) -> torch.Tensor:
    """A patch's wire form, assembled (the device path; the host path writes it in place)."""
    values = patch.values.contiguous().reshape(-1)
    values = values.view(torch.uint8) if values.dtype == torch.bool else values
    device = values.device
    values_at, size = bitdiff.layout(patch.changed, DIGEST_BYTES, patch.positions.element_size(), values.element_size())
    header = torch.frombuffer(bytearray(_DIGEST.pack(digest_value)), dtype=torch.uint8).to(device)
    positions = patch.positions.contiguous().view(torch.uint8)
    padding = torch.zeros(values_at - DIGEST_BYTES - positions.numel(), dtype=torch.uint8, device=device)
    blob = torch.cat([header, positions, padding, values.view(torch.uint8)])
    assert blob.numel() == size
    return blob


def _views(blob: torch.Tensor, count: int, numel: int, dtype: torch.dtype, *, prefix: int) -> Patch:
    """The patch a wire form (or, ``prefix`` 0, a bare positions-then-values blob) holds."""
    positions_dtype = position_dtype(numel)
    width = torch.empty((), dtype=dtype).element_size()
    position_width = torch.empty((), dtype=positions_dtype).element_size()
    if count == 0:  # an empty slice of a byte tensor cannot be viewed as wider elements
        empty = torch.empty(0, dtype=_SAME_WIDTH_INTEGER[width], device=blob.device)
        return Patch(torch.empty(0, dtype=positions_dtype, device=blob.device), _typed(empty, dtype), numel)
    values_at, _ = bitdiff.layout(count, prefix, position_width, width)
    positions = blob[prefix : prefix + count * position_width].view(positions_dtype)
    values = _typed(blob[values_at : values_at + count * width].view(_SAME_WIDTH_INTEGER[width]), dtype)
    return Patch(positions=positions, values=values, numel=numel)


def can_pay(tensor: torch.Tensor) -> bool:
    """Whether a patch of ``tensor`` in its wire form (:func:`compare` with ``encoded``) can
    be fewer bytes than the tensor: its elements compare bit for bit and an empty patch, its
    digest included, is smaller than it. A tensor that cannot is only ever sent whole."""
    return most_changed(tensor) >= 0


def patchable(tensor: torch.Tensor) -> bool:
    """Whether :func:`diff` compares ``tensor``'s elements (1, 2, 4 or 8 bytes each, not a
    quantized tensor); others travel whole."""
    return tensor.element_size() in _SAME_WIDTH_INTEGER and not tensor.is_quantized


def copy_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor``, made byte for byte (which works for dtypes that have no
    copy kernel of their own, such as the 1-bit integers). On the host, from the process's
    pool of mappings (:mod:`ckpt_core._internal.host_alloc`): a copy made again after one was
    dropped (a weight tracked again after a rest) reuses its pages, already faulted in."""
    source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if source.device.type == "cpu":
        copy = empty_host(source.shape, torch.uint8)
        copy.copy_(source)
    else:
        copy = source.clone()
    return copy.view(tensor.dtype).reshape(tensor.shape)


def _bits(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor``'s elements as integers of the same width, flat (a view where it can be)."""
    integer = _SAME_WIDTH_INTEGER.get(tensor.element_size())
    if integer is None or not patchable(tensor):
        raise DeltaError(f"{name}: {tensor.dtype} elements cannot be compared bit for bit")
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if tensor.dtype == torch.bool else flat.view(integer)


def _typed(integers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Same-width integers seen as ``dtype`` (``bool`` from bytes)."""
    return integers.view(torch.bool) if dtype == torch.bool else integers.view(dtype)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return np.dtype(np.int32) if dtype == torch.int32 else np.dtype(np.int64)
