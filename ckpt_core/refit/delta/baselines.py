"""Delta refits' two stages: the sender's, which sends each weight as a patch against what its
destination holds where that pays, and the receiver's, which turns the patches back into whole
weights. Both sit above the pipeline (as layouts and quantize-on-send do), one pair per
destination stream; the patches are :mod:`ckpt_core.refit.delta`'s.

Each side keeps a :class:`Baseline`: a copy of the weights of the last refit it completed, with
that refit's version (a token the sender draws for each refit). A refit through
:meth:`DeltaSender.encode` and :meth:`DeltaReceiver.decode` carries, first, a manifest naming
the version its patches were made against and the version it makes; then each weight either
whole under its own name (both sides keep a copy); or as a patch, under ``<name>`` +
:data:`PATCH_SUFFIX`: the patch's wire form (:func:`ckpt_core.refit.delta.compare`: the new weight's
digest, its positions, its values); or whole under ``<name>`` + :data:`UNTRACKED_SUFFIX`, a
weight neither side keeps a copy of.

**The choice, weight by weight** (:mod:`ckpt_core.refit.delta.choice`): a weight is *tracked* (both
sides keep a copy; sent as a patch where that is fewer bytes) or *watched* (sent whole and
untracked, its changes measured on a sixteenth of it); the sender's model of its own refit
times moves weights between the two. Weights released by the model leave both baselines at the
refit's manifest. Weights no patch can pay for (0-d, empty, elements not compared bitwise)
always go untracked. Every choice is counted in the refit's :class:`~ckpt_core.stats.RefitStats`.

What it guarantees:

* a patch applies only to the version it was made against: a receiver holding another (a
  new or restarted one, one that missed or failed a refit) refuses the refit at its manifest,
  before any weight, with :class:`BaselineMismatchError`, and keeps what it holds; a refit
  made against no version (every weight whole) is taken by any receiver;
* every patched weight is checked against the sender's digest of the new weight
  (:class:`~ckpt_core.errors.IntegrityError` naming it on a mismatch): hashed whole at its
  first patch, then made from its terms and the words each patch writes, with a sixteenth of
  the copy audited per patch (:class:`DeltaReceiver`);
* a baseline moves only with :meth:`~DeltaSender.commit`, which a side calls once its refit
  completed: a refit that failed anywhere leaves both baselines as they were (the sender's
  copies, patched as it compared them, are put back), but for the weights its manifest
  released, which both sides drop as it is sent and received. A sender that cannot know whether its
  destination completed (it failed, or its destination reports another version when they meet
  again) calls :meth:`~DeltaSender.forget`, and its next refit sends every weight whole.

What it costs: each side holds a copy of every weight it tracks (its :attr:`Baseline.nbytes`);
the sender compares each weight with its copy (one pass over both, in which the copy is
patched and the new weight hashed) and copies each weight it sends whole and tracked; the
receiver patches its copy (in time that follows a sparse patch), reads a sixteenth of it
(the audit; all of it at a copy's first patch and at a dense one) and keeps each weight
received whole and tracked (as it arrived where it owns it, else a copy). A sender given
``max_baseline_bytes`` keeps copies of the weights that fit in it, in the order it sends them (the same weights every
refit where the order and shapes stay), and sends the rest whole and untracked, so that its
destination keeps no copy of them either: each side's baseline of one stream stays within
that bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ckpt_core._internal import bitdiff
from ckpt_core.errors import IntegrityError, LifecycleError, WireFormatError
from ckpt_core.refit.delta import (
    Patch,
    apply,
    apply_and_digest,
    audit,
    audit_classes,
    can_pay,
    compare,
    copy_bits,
    decode,
    fits_sample,
    most_changed,
    sample_changes,
    take_sample,
)
from ckpt_core.refit.delta.choice import RETRACK, CostModel, RefitCosts, WeightHistory
from ckpt_core.stats import RefitStats

__all__ = [
    "Baseline",
    "BaselineMismatchError",
    "DeltaReceiver",
    "DeltaSender",
    "DeltaState",
    "MANIFEST_NAME",
    "PATCH_SUFFIX",
    "UNTRACKED_SUFFIX",
]

MANIFEST_NAME = "\x00ckpt-engine.delta"
"""The name of a delta refit's first entry (a ``uint8`` tensor of JSON); no weight has it."""
PATCH_SUFFIX = "\x00patch"
"""Appended to a weight's name when it travels as a patch."""
UNTRACKED_SUFFIX = "\x00untracked"
"""Appended to a weight's name when it travels whole and neither side keeps a copy of it."""
_FORMAT_VERSION = 5  # 2: untracked; 3: leaf digests, 8-byte aligned values; 4: released weights; 5: word digests


class BaselineMismatchError(LifecycleError):
    """A refit's patches were made against a version of the weights the receiver does not hold
    (the message names both): nothing was applied, the receiver keeps what it holds. The
    sender must send every weight whole (``DeltaSender.forget``)."""


@dataclasses.dataclass(frozen=True)
class CopyTerms:
    """What a receiver knows of a copy it patched: its digest terms by leaf class (as
    :func:`~ckpt_core.refit.delta.apply_and_digest` made them, matching the sender's digest),
    and the class of leaves its next patch audits (:func:`~ckpt_core.refit.delta.audit`)."""

    sums: np.ndarray
    audits: int = 0


@dataclasses.dataclass(frozen=True)
class Baseline:
    """What one side holds of one destination's weights after a completed refit: a copy of
    each (contiguous, owned) and that refit's version (``None``: nothing yet). The copies are
    patched in place by later refits (the sender's at commit, the receiver's as it receives,
    put back if that refit fails), so one ``Baseline`` object is the current one only."""

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    version: str | None = None
    digests: dict[str, int] = dataclasses.field(default_factory=dict)
    """The :func:`~ckpt_core.refit.delta.digest` of a copy, where its side made one (a sender's
    copies it patched): its next comparison makes the new version's from the changes alone."""
    terms: dict[str, CopyTerms] = dataclasses.field(default_factory=dict)
    """A receiver's copies' digest terms, where it patched them on the host: its next patch of
    each makes the digest from the words it writes alone, and audits one class of leaves."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclasses.dataclass
class _Pending:
    """A sender's refit as it is encoded, until its commit or discard: the baseline it is made
    against, and per weight sent tracked, either the patch that undoes the in-place patching
    of its copy (sent as a patch) or a copy of it (sent whole); ``complete`` once every weight
    was encoded."""

    base: Baseline
    version: str
    sent: dict[str, torch.Tensor | Patch] = dataclasses.field(default_factory=dict)
    digests: dict[str, int] = dataclasses.field(default_factory=dict)  # of the copies patched
    names: set[str] = dataclasses.field(default_factory=set)  # every weight encoded, tracked or not
    compare_seconds: float = 0.0
    copy_seconds: float = 0.0  # copying weights sent whole and tracked
    tracked_bytes: int = 0  # of the weights sent whole and kept
    untracked_bytes: int = 0  # of the weights sent whole and not kept
    released_bytes: int = 0  # of those, the ones the destination held a copy of until now
    patched_bytes: int = 0  # of the weights sent as patches
    first_patched_bytes: int = 0  # of those, host copies patched for the first time (hashed whole)
    changed: int = 0  # elements those patches changed
    upstream_seconds: float = 0.0  # waiting for the weights (the trainer's, any stage before this)
    complete: bool = False

    def timed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights``, each one's time to come added to ``upstream_seconds``."""
        source = iter(weights)
        while True:
            start = time.perf_counter()
            item = next(source, None)
            self.upstream_seconds += time.perf_counter() - start
            if item is None:
                return
            yield item

    def untracked(
        self, name: str, tensor: torch.Tensor, stats: RefitStats, *, chosen: bool, released: bool = False
    ) -> tuple[str, torch.Tensor]:
        """The entry of a weight sent whole with no copy kept (``chosen``: by the choice, not
        the bound; ``released``: the destination held a copy until this refit, which frees it:
        the refit's time is not a steady one's), counted."""
        nbytes = tensor.numel() * tensor.element_size()
        stats.untracked_tensors += 1
        stats.chosen_whole_tensors += chosen
        self.untracked_bytes += nbytes
        self.released_bytes += nbytes if released else 0
        return name + UNTRACKED_SUFFIX, tensor

    def tracked(self, name: str, tensor: torch.Tensor, stats: RefitStats) -> tuple[str, torch.Tensor]:
        """The entry of a weight sent whole and kept: a copy of it is the next baseline's."""
        start = time.perf_counter()
        self.sent[name] = copy_bits(tensor.detach())
        self.copy_seconds += time.perf_counter() - start
        stats.whole_tensors += 1
        self.tracked_bytes += tensor.numel() * tensor.element_size()
        return name, tensor

    def committed(self) -> Baseline:
        """The next baseline: each patched copy (patched already, with its digest), each whole
        one's copy."""
        tensors = {}
        for name, entry in self.sent.items():
            tensors[name] = self.base.tensors[name] if isinstance(entry, Patch) else entry
        return Baseline(tensors, self.version, dict(self.digests))

    def undo(self) -> None:
        """Put back every copy patched so far (newest first)."""
        for name, entry in reversed(self.sent.items()):
            if isinstance(entry, Patch):
                apply(self.base.tensors[name], entry, name=name)
        self.sent.clear()


def _comparable(old: torch.Tensor, new: torch.Tensor) -> bool:
    return (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)


class DeltaSender:
    """The sender's stage for one destination stream (``destination`` names it in errors),
    keeping at most ``max_baseline_bytes`` of copies (``None``: every weight; module docstring)."""

    def __init__(self, *, destination: str, max_baseline_bytes: int | None = None) -> None:
        self.destination = destination
        self.max_baseline_bytes = max_baseline_bytes
        self.baseline = Baseline()
        self.costs = CostModel()
        """What the choice between patches and whole weights predicts time with."""
        self._history: dict[str, WeightHistory] = {}
        self._pending: _Pending | None = None

    def encode(
        self, weights: Iterable[tuple[str, torch.Tensor]], stats: RefitStats
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """``weights`` as this refit sends them: the manifest, then each weight whole, as a
        patch against the baseline, or whole and untracked (the module docstring says which),
        counted into ``stats`` (its delta fields) as they go. The weights become the next
        baseline at :meth:`commit` (a copy of each weight sent whole and tracked: the caller
        may change its weights once they were sent); :meth:`discard` puts the baseline back."""
        self.discard()  # a refit abandoned before its end is put back first
        base = self.baseline
        pending = self._pending = _Pending(base, uuid.uuid4().hex)
        self._report_model(stats)
        # Tracked weights the model releases leave both baselines at the manifest, before
        # they arrive: the receiver's copies free their memory for them.
        released = {name for name, held in base.tensors.items() if self._releases(name, held)}
        for name in released:
            del base.tensors[name]
            base.digests.pop(name, None)
        yield MANIFEST_NAME, _manifest(base.version, pending.version, sorted(released))
        tracked_bytes = 0
        for name, tensor in pending.timed(weights):
            if name in pending.names:
                raise WireFormatError(f"{self.destination}: the sender yields weight {name!r} twice in one refit")
            pending.names.add(name)
            stats.delta_tensors += 1
            nbytes = tensor.numel() * tensor.element_size()
            if not can_pay(tensor):
                yield pending.untracked(name, tensor, stats, chosen=True)
                continue
            old = base.tensors.get(name)
            if self.max_baseline_bytes is not None and tracked_bytes + nbytes > self.max_baseline_bytes:
                yield pending.untracked(name, tensor, stats, chosen=False, released=old is not None)
                continue
            tracked_bytes += nbytes  # its place in the bound, kept while it is watched
            history = self._history.setdefault(name, WeightHistory())
            if name in released:
                history.sample = take_sample(tensor, name=name)
                history.measuring = not self.costs.knows_whole
                yield pending.untracked(name, tensor, stats, chosen=True, released=True)
                continue
            if old is None or not _comparable(old, tensor):
                if history.watched and self._stays_watched(name, tensor, history, stats):
                    yield pending.untracked(name, tensor, stats, chosen=True)
                    continue
                history.fraction, history.sample, history.measuring = None, None, False  # new, reshaped, or back
                yield pending.tracked(name, tensor, stats)
                continue
            # Screened first unless its last comparison found it well below the break-even.
            screen = history.fraction is None or 2 * history.fraction * tensor.numel() > most_changed(tensor)
            start = time.perf_counter()
            found = compare(
                old, tensor, name=name, encoded=True, update=True, screen=screen, old_digest=base.digests.get(name)
            )
            pending.compare_seconds += time.perf_counter() - start
            history.fraction = found.changed / max(1, found.compared)
            if found.patch is None:  # no patch is fewer bytes: whole, and watched from now on
                history.sample = take_sample(tensor, name=name)
                yield pending.untracked(name, tensor, stats, chosen=True, released=True)
                continue
            assert found.undo is not None and found.encoded is not None and found.digest is not None
            pending.sent[name] = found.undo
            pending.digests[name] = found.digest
            pending.patched_bytes += nbytes
            if old.device.type == "cpu" and name not in base.digests:  # both sides hash this copy whole
                pending.first_patched_bytes += nbytes
            pending.changed += found.changed
            _count_patch(stats, found.patch, tensor)
            yield name + PATCH_SUFFIX, found.encoded
        stats.delta_seconds += pending.compare_seconds + pending.copy_seconds
        pending.complete = True

    def _releases(self, name: str, held: torch.Tensor) -> bool:
        """Whether tracked weight ``name`` (its copy ``held``) is released this refit: the model
        predicts it faster whole, at the fraction its last comparison found."""
        history = self._history.get(name)
        if history is None or history.fraction is None:
            return False
        return self.costs.releases(held.numel() * held.element_size(), held.numel(), history.fraction)

    def _stays_watched(self, name: str, tensor: torch.Tensor, history: WeightHistory, stats: RefitStats) -> bool:
        """Measure a watched weight's changes since the last refit on its sample (refreshing
        it); whether it stays watched: the model neither predicts its patch to pay nor
        rechecks it (counted into ``stats``)."""
        assert history.sample is not None
        if not fits_sample(history.sample, tensor):  # reshaped while watched: a new weight
            return False
        start = time.perf_counter()
        changed, compared = sample_changes(history.sample, tensor, name=name)
        pending = self._pending
        assert pending is not None
        pending.compare_seconds += time.perf_counter() - start
        history.fraction = changed / max(1, compared)
        if changed > most_changed(tensor) * compared / tensor.numel():  # no patch would be fewer bytes
            return True
        nbytes = tensor.numel() * tensor.element_size()
        measured = history.measuring and self.costs.knows_whole
        if self.costs.retracks(nbytes, tensor.numel(), history.fraction, margin=1.0 if measured else RETRACK):
            return False
        if measured:  # its one choice without the margin was made
            history.measuring = False
        if self.costs.rechecks(nbytes, tensor.numel(), history.fraction):
            stats.rechecked_tensors += 1
            return False
        return True

    def _report_model(self, stats: RefitStats) -> None:
        """The costs this refit's choices are made with, into ``stats`` (none yet: zeros)."""
        whole, patched, changed = self.costs.per_byte_whole, self.costs.per_byte_patched, self.costs.per_changed
        if whole is not None and patched is not None and changed is not None:
            stats.delta_whole_gbps = 1e-9 / whole if whole else math.inf
            stats.delta_patched_gbps = 1e-9 / patched if patched else math.inf
            stats.delta_changed_ns = changed * 1e9

    def commit(self, stats: RefitStats | None = None) -> None:
        """The refit :meth:`encode` made completed at its destination: its weights are the
        baseline now. ``stats``, the refit's own account of this stream (its ``seconds``),
        feeds the cost model the next refits choose with. Refused (``LifecycleError``) without
        a refit encoded to its end."""
        pending = self._pending
        if pending is None or not pending.complete:
            raise LifecycleError(f"{self.destination}: no encoded refit to commit")
        self._pending = None
        self.baseline = pending.committed()
        self._history = {name: history for name, history in self._history.items() if name in pending.names}
        if stats is not None:
            # What the choice changes: not the time its weights took to come, nor its copies' (a
            # tracked weight is copied whichever way it goes next).
            seconds = stats.seconds - pending.upstream_seconds - pending.copy_seconds
            self.costs.add(
                RefitCosts(
                    seconds,
                    pending.tracked_bytes,
                    pending.untracked_bytes,
                    pending.patched_bytes,
                    pending.changed,
                    released_bytes=pending.released_bytes,
                    first_patched_bytes=pending.first_patched_bytes,
                )
            )

    def discard(self) -> None:
        """The refit failed at its destination (or before): the baseline stays as it was (its
        copies patched so far are put back)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.undo()
            except BaseException:
                self.forget()  # a copy half put back is no baseline
                raise

    def forget(self) -> None:
        """Whether the destination holds the baseline is unknown: drop it (the next refit
        sends every weight whole)."""
        self.baseline, self._pending = Baseline(), None
        self._history = {}


class DeltaReceiver:
    """The receiver's stage for one stream (``source`` names the sender in errors): a refit's
    entries go through :meth:`receive` one by one, in order, then :meth:`end`; or all at once
    through :meth:`decode`. Patches are applied to the baseline's copies in place, each with
    the old values it overwrote kept until :meth:`commit`, so that :meth:`discard` (or the
    next refit's manifest, before a commit) puts the baseline back bit for bit.

    ``keeps_received``: the tensors given to :meth:`receive` own their memory (no transport
    reuses it), so a weight received whole is kept as it is, not copied; without it (a
    receiver whose tensors are views of buffers it lends out), each is copied.

    Each patched copy is checked against the sender's digest of the new weight. The first
    patch of a copy hashes it whole, and so does a dense one; later sparse ones make the digest
    from the copy's terms and the words the patch writes, and read one sixteenth of the copy
    (a class of its leaves, each in turn) against its terms: a copy that differs from the
    sender's where a patch writes is caught by that patch, anywhere else by the next patch
    that hashes it or audits that class (within 16 patches of the weight). ``whole_check``:
    every patch hashes the copy whole (caught at the next)."""

    def __init__(self, *, source: str, keeps_received: bool = False, whole_check: bool = False) -> None:
        self.source = source
        self.keeps_received = keeps_received
        self.whole_check = whole_check
        self.baseline = Baseline()
        self._refit: _Receiving | None = None  # receiving, or received to its end and not committed
        self._ended = False

    def decode(
        self, weights: Iterable[tuple[str, torch.Tensor]], stats: RefitStats
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The refit's weights, whole, as the sender yielded them (:meth:`receive` over
        ``weights``, then :meth:`end`)."""
        for name, tensor in weights:
            entry = self.receive(name, tensor, stats)
            if entry is not None:
                yield entry
        self.end()

    def receive(self, name: str, tensor: torch.Tensor, stats: RefitStats) -> tuple[str, torch.Tensor] | None:
        """One entry of the refit, as a whole weight, counted into ``stats`` (its delta
        fields): ``None`` for the manifest (the first entry); a weight received whole is passed
        on as received (and kept, as it is with ``keeps_received``, else as a copy, unless it
        came untracked); a patched one is the baseline's copy, patched in place and checked.
        A weight kept as it is, or patched, is the caller's to read (or copy), never to write
        to: later refits patch it again (a write is caught by the digest check or the audit:
        class docstring)."""
        if self._refit is None or self._ended or name == MANIFEST_NAME:  # a manifest starts a refit
            self.discard()  # what an abandoned refit patched is put back first
            if name != MANIFEST_NAME:
                raise WireFormatError(f"a delta refit from {self.source} starts with its manifest, got {name!r}")
            base_version, version, released = _read_manifest(tensor, self.source)
            if base_version is not None and base_version != self.baseline.version:
                raise BaselineMismatchError(
                    f"{self.source} made this refit's patches against weights version {base_version}, but this "
                    f"receiver holds {self.baseline.version}: nothing was applied; the sender must send every "
                    "weight whole"
                )
            # What the sender holds no more, this receiver drops now, before the weights arrive
            # (their memory is free for them): all of it for a refit made against nothing.
            if base_version is None:
                self.baseline = Baseline()
            for weight in released:
                self.baseline.tensors.pop(weight, None)
            self._refit = _Receiving(self.baseline, version, audited=not self.whole_check)
            return None
        refit = self._refit
        stats.delta_tensors += 1
        weight = name.removesuffix(PATCH_SUFFIX).removesuffix(UNTRACKED_SUFFIX)
        if weight in refit.kept or weight in refit.untracked:
            raise WireFormatError(f"{self.source} sent weight {weight!r} twice in one refit")
        if name.endswith(UNTRACKED_SUFFIX):  # past the sender's bound, or not worth a copy: none kept
            refit.untracked.add(weight)
            stats.untracked_tensors += 1
            return weight, tensor
        if not name.endswith(PATCH_SUFFIX):
            start = time.perf_counter()
            keep = self.keeps_received and tensor.is_contiguous() and not tensor.requires_grad
            refit.kept[name] = tensor if keep else copy_bits(tensor.detach())
            refit.terms.pop(name, None)
            stats.delta_seconds += time.perf_counter() - start
            stats.whole_tensors += 1
            return name, tensor
        held = refit.base.tensors.get(weight)
        if held is None:
            raise WireFormatError(f"{self.source} sent a patch of {weight!r}, which this receiver does not hold")
        start = time.perf_counter()
        patch, digest = decode(tensor, held, name=weight)
        refit.patch(weight, held, patch, digest, source=self.source)
        stats.delta_seconds += time.perf_counter() - start
        _count_patch(stats, patch, held)
        return weight, held

    def end(self) -> None:
        """Every entry of the refit was received: its weights are the next baseline, at
        :meth:`commit`. ``WireFormatError`` if not even the manifest came."""
        if self._refit is None or self._ended:
            raise WireFormatError(f"a delta refit from {self.source} starts with its manifest, got nothing")
        self._ended = True

    def commit(self) -> None:
        """The refit received to its :meth:`end` completed: its weights are the baseline now."""
        if self._refit is None or not self._ended:
            raise LifecycleError(f"from {self.source}: no decoded refit to commit")
        kept = self._refit.kept
        terms = {name: known for name, known in self._refit.terms.items() if name in kept}
        self.baseline = Baseline(kept, self._refit.version, terms=terms)
        self._refit, self._ended = None, False

    def discard(self) -> None:
        """The refit failed (or was not committed): what it patched is put back, the baseline
        stays; the next entry received starts a new refit."""
        if self._refit is not None:
            self._refit.undo()
        self._refit, self._ended = None, False


@dataclasses.dataclass
class _Receiving:
    """A refit a receiver takes: the baseline it patches, the version it makes, each weight
    it kept, those it passed on untracked, the values its patches overwrote (newest last),
    and its copies' digest terms as the refit leaves them."""

    base: Baseline
    version: str
    audited: bool = True  # else each patched copy is hashed whole
    kept: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    untracked: set[str] = dataclasses.field(default_factory=set)
    overwritten: list[tuple[str, torch.Tensor, Patch]] = dataclasses.field(default_factory=list)
    terms: dict[str, CopyTerms] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.terms = dict(self.base.terms) if self.audited else {}  # the baseline's stay as they are until the commit

    def patch(self, name: str, held: torch.Tensor, patch: Patch, digest: int, *, source: str) -> None:
        """Apply ``patch`` to ``held`` in place, keeping the values it overwrites, and check
        the result against the sender's ``digest``: made from the copy's digest terms and the
        words the patch writes where this receiver knows the terms and the patch is sparse
        (then one class of the copy's leaves is read whole and checked against its terms:
        each class in turn, one per such patch), else hashed whole."""
        known = self.terms.pop(name, None)
        applied = apply_and_digest(held, patch, name=name, terms=None if known is None else known.sums)
        self.overwritten.append((name, held, applied.undo))
        self.kept[name] = held
        if applied.digest != digest:
            raise IntegrityError(
                f"{name}: patched from {source}'s patch, it does not match the sender's digest of the "
                "new weight: this receiver's copy differs from the sender's"
            )
        sums = applied.terms
        if sums is None or not self.audited:  # a device tensor (hashed whole by torch), or asked for
            return
        audits = 0 if known is None else known.audits
        if not applied.hashed:  # what the digest did not read, a class at a time
            number = audits % audit_classes(held)
            if not audit(held, sums, number):
                raise IntegrityError(
                    f"{name}: this receiver's copy changed where no patch wrote (its leaves of class {number}, "
                    f"the 1 MiB runs {number}, {number} + {bitdiff.AUDIT_CLASSES}, ...): something wrote into a "
                    "weight received earlier (received weights are the caller's to read, not to write)"
                )
            audits += 1
        self.terms[name] = CopyTerms(sums, audits)

    def undo(self) -> None:
        while self.overwritten:
            name, held, old = self.overwritten.pop()
            apply(held, old, name=name)


class DeltaState:
    """What an engine with delta refits keeps across refits and re-inits (``finalize()`` and
    ``prepare()`` again): a :class:`DeltaSender` per destination stream it sends to, keyed by
    the stream's rollout ranks, and its own :class:`DeltaReceiver`. Its receiver's baseline
    version travels in the engine's ``prepare()`` metadata (:meth:`metadata`); a policy engine
    checks each destination's at init (:meth:`connect`)."""

    METADATA_KEY = "delta_baseline"

    def __init__(
        self, *, max_baseline_bytes: int | None = None, keeps_received: bool = False, whole_check: bool = False
    ) -> None:
        self.max_baseline_bytes = max_baseline_bytes  # each sender's bound
        self.senders: dict[tuple[int, ...], DeltaSender] = {}
        self.receiver = DeltaReceiver(source="the policy", keeps_received=keeps_received, whole_check=whole_check)

    def metadata(self) -> dict[str, str | None]:
        return {self.METADATA_KEY: self.receiver.baseline.version}

    @staticmethod
    def warm_up(devices: Iterable[torch.device]) -> None:
        """Where the engine's buffers are host memory, its refits compare and patch on the
        host: their kernels are loaded in the background now, not by the first refit."""
        if any(device.type == "cpu" for device in devices):
            bitdiff.warm_up_in_background()

    def connect(self, streams: Mapping[tuple[int, ...], str], reported: Mapping[int, Any]) -> None:
        """The streams of this init (rollout ranks -> how messages name them) and the baseline
        version each rollout rank reported: a stream's sender keeps its baseline only if every
        rank of the stream holds that version (else its next refit is whole); senders of
        streams no longer sent to are dropped, with their memory."""
        senders = {}
        for ranks, label in streams.items():
            sender = self.senders.get(ranks) or DeltaSender(
                destination=label, max_baseline_bytes=self.max_baseline_bytes
            )
            if any(reported.get(rank) != sender.baseline.version for rank in ranks):
                sender.forget()
            senders[ranks] = sender
        self.senders = senders

    def commit_senders(self, stats: Mapping[tuple[int, ...], RefitStats]) -> None:
        """Every stream's refit completed; ``stats``: each stream's account of it."""
        for ranks, sender in self.senders.items():
            sender.commit(stats.get(ranks))

    def discard_senders(self) -> None:
        for sender in self.senders.values():
            sender.discard()

    @property
    def baseline_bytes(self) -> int:
        """Bytes held: every sender's baseline and the receiver's."""
        return sum(s.baseline.nbytes for s in self.senders.values()) + self.receiver.baseline.nbytes


def _count_patch(stats: RefitStats, patch: Patch, weight: torch.Tensor) -> None:
    stats.patched_tensors += 1
    stats.patched_elements += weight.numel()
    stats.changed_elements += patch.changed


def _manifest(base: str | None, version: str, released: list[str]) -> torch.Tensor:
    data = json.dumps(
        {
            "format": "ckpt-engine.delta",
            "version": _FORMAT_VERSION,
            "base": base,
            "makes": version,
            "released": released,
        }
    )
    return torch.frombuffer(bytearray(data.encode()), dtype=torch.uint8)


def _read_manifest(tensor: torch.Tensor, source: str) -> tuple[str | None, str, list[str]]:
    """A manifest's ``(base, makes, released)``: the version its patches are made against
    (``None``: none), the version it makes, and the weights that leave the baseline at once."""
    try:
        data = json.loads(bytes(tensor.cpu().numpy().tobytes()))
        if data["format"] != "ckpt-engine.delta" or data["version"] != _FORMAT_VERSION:
            raise ValueError(
                f"format {data['format']!r} version {data['version']!r}, this ckpt-core reads version "
                f"{_FORMAT_VERSION}: give both sides the same ckpt-core"
            )
        base, makes, released = data["base"], data["makes"], data["released"]
        if not (base is None or isinstance(base, str)) or not isinstance(makes, str):
            raise ValueError("base and makes must be version strings")
        if not isinstance(released, list) or not all(isinstance(name, str) for name in released):
            raise ValueError("released must be a list of weight names")
    except (ValueError, KeyError, TypeError) as exc:
        raise WireFormatError(f"the delta manifest from {source} is malformed: {exc}") from None
    return base, makes, released
