"""How a delta refit's sender chooses, weight by weight, between a patch and the whole weight.

A patch is fewer bytes wherever few enough elements changed, but not always less time: finding
it reads the weight and its copy, and each changed element costs something on both sides (laid
out and hashed on the sender, written into the receiver's copy). Where the wire is fast (a
loopback, NVLink) a patch of a few percent can take longer than the whole weight; where it is
slow (a cross-node link) a patch of a third can still win. So the sender measures, and chooses.

Each weight a patch can pay for is, at each refit, in one of two states (:class:`WeightHistory`):

* **tracked**: both sides hold a copy of it; it is compared with its copy and sent as a patch
  where that is fewer bytes (a comparison that finds no patch of fewer bytes sends it whole and
  starts watching it). Its changed fraction is what its last comparison found.
* **watched**: neither side holds a copy (copying it would cost more than it saves); it is sent
  whole, and the sender keeps only a copy of a sixteenth of it, the ranges a screening
  comparison reads (:func:`ckpt_core.refit.delta.sample_ranges`), which it compares and refreshes at
  each refit: its changed fraction, step by step, for a sixteenth of a comparison's cost.

:class:`CostModel` fits the time of a stream's refits to what they moved, and decides the moves
between the two: a tracked weight whose fraction makes its patch predicted slower than the whole
weight is released (at the refit's manifest: the receiver frees its copy before the weights
arrive) and watched; a watched weight whose patch is predicted to take at most
:data:`RETRACK` of its whole time is tracked again (sent whole, both sides keep a copy) and
compared from the next refit on. A refit far slower than the model predicted is learnt from as
at most :data:`SURPRISE` times the prediction, unless it repeats: one refit slowed by its host
moves the choices only near the break-even. Until the model has evidence
(:data:`MIN_EVIDENCE_BYTES` sent each way), the choice is by bytes alone: a patch wherever one
is fewer bytes.

What a stream has not sent for a while, its refits do not teach: weights released while the
host was slow are sent whole from then on, and the patched fit that released them would stay
as the slow spell left it. So the evidence of each kind ages with the stream's refits, not
with its own (a kind learnt again after a long gap is learnt afresh), and after
:data:`RECHECK_AFTER` refits that taught the patched part nothing, the model rechecks it: the
watched weights whose patches it predicts within :data:`RECHECK` of their whole time are
tracked again together, and kept through the refits that measure their patches (the copy, the
first patch, then one that teaches). A recheck that brings no patches back doubles the wait
for the next (up to :data:`RECHECK_AFTER_MAX`), so that where patches do not pay, rechecking
costs a few percent at first and less and less after.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

__all__ = [
    "CostModel",
    "DECAY",
    "EXPLORE",
    "MIN_EVIDENCE_BYTES",
    "MIN_PATCHED_REFITS",
    "RECHECK",
    "RECHECK_AFTER",
    "RECHECK_AFTER_MAX",
    "RETRACK",
    "SURPRISE",
    "RefitCosts",
    "WeightHistory",
]

MIN_EVIDENCE_BYTES = 64 << 20
"""The bytes a refit stream must have sent each way before its model decides."""
MIN_PATCHED_REFITS = 2
"""The refits of patches the model must have learnt from before it releases a tracked weight:
the first one after a stream's copies are made varies most (on cuda_ipc, host memory, 1 GiB at
0.1%: 0.121-0.174 s in four runs, against 0.11-0.14 s for the patches after), and alone it
would decide."""
DECAY = 0.7
"""The weight of a refit's measurements against the next refit's: what a kind learnt ``k``
refits of the stream ago weighs ``DECAY ** k`` against what it learns now."""
EXPLORE = 0.25
"""Until a stream has sent weights whole and untracked, a weight's whole time is taken as this
share of a tracked one's (an upper bound on an untracked one's: the first refit of a stream
also faults in the memory of every copy and received weight, which made it 3x an untracked
refit on cuda_ipc, host memory, 1 GiB): a patch predicted to cost more is released, which
measures the untracked time, and is tracked again only once that is known (or its patch
became cheaper), then wherever its patch is predicted faster (:attr:`WeightHistory.measuring`).
Over a link 10x slower than memory a patch of 1% costs well under this share, and is kept."""
RETRACK = 0.8
"""A watched weight is tracked again where its patch is predicted to take at most this share
of its whole time: the margin keeps a weight near the break-even from moving (and being copied)
at every refit."""

RECHECK_AFTER = 16
"""Refits of a stream in a row that taught the patched part nothing, after which the model
rechecks it (module docstring)."""
RECHECK_AFTER_MAX = 256
"""The longest wait between rechecks: each recheck that brings no patches back doubles it."""
RECHECK = 1.5
"""A recheck tracks again the watched weights whose patches are predicted to take at most this
share of their whole time, and keeps them until the patched part was learnt again: a slow
spell that made patches look up to half again as slow as they are is undone by it."""
_RECHECK_REFITS = 3  # a weight tracked again is copied, patched for the first time, then learnt from
_AGE_LIMIT = 32  # refits: evidence older than DECAY ** 32 (1e-5 of a new refit's) counts for nothing

SURPRISE = 1.25
"""A refit that takes longer than this share of what the model predicts for it is learnt from as
if it had taken that long, unless the refit learnt from before it took longer too. One refit
slowed by its host (a shared machine's other work; 1.5x and more was seen here) would otherwise
move the fit by a third of its excess for the next refits, enough to release weights whose
patches pay, which a whole weight's refits do not teach back; a lasting change is learnt from
its second refit on."""

_GB = 1e9
# The kinds of bytes a refit pays for once per copy (freeing it; its first patch, which hashes it
# whole): a refit mostly of them is not learnt from.
_ONE_TIME = frozenset({"released", "first patched"})
# The prior the patched fit is held near (seconds per GB patched, per G elements changed): a
# guess that a refit's data outweighs as soon as there is any, and that decides the split of
# time between the two only while every refit changed about the same fraction. Its strength
# is relative to the data's own (a thousandth of it).
_PRIOR = np.array([0.1, 5.0])
_PRIOR_STRENGTH = 1e-3


@dataclasses.dataclass
class WeightHistory:
    """What the sender's choice knows of one weight: its changed ``fraction`` (found by its
    last comparison when tracked, by its sample when watched; ``None``: unknown, as for a
    weight tracked again, until its next comparison), and, when it is watched, its ``sample``
    (a copy of its screening ranges as last sent)."""

    fraction: float | None = None
    sample: torch.Tensor | None = None
    measuring: bool = False
    """Released to measure what whole weights cost (before any refit of untracked weights
    was learnt: :data:`EXPLORE`), not on a measured verdict: at its first choice with that cost
    known, it is tracked again wherever its patch is predicted faster, without
    :data:`RETRACK`'s margin."""

    @property
    def watched(self) -> bool:
        return self.sample is not None


@dataclasses.dataclass(frozen=True)
class RefitCosts:
    """What one refit of a stream moved, and how long it took: what the model learns from.
    ``tracked_bytes`` are of the weights sent whole and kept (copied on both sides),
    ``untracked_bytes`` of those sent whole and not kept, ``patched_bytes`` of those sent as
    patches, which changed ``changed_elements`` elements."""

    seconds: float
    tracked_bytes: int
    untracked_bytes: int
    patched_bytes: int
    changed_elements: int
    released_bytes: int = 0
    """Of the weights sent whole and not kept, those both sides held copies of until this
    refit: it frees those copies (at the manifest, or, for a weight whose comparison found no
    patch of fewer bytes, the receiver receives it into fresh memory while still holding its
    copy), which a refit of weights neither side holds does not pay (on cuda_ipc, host
    memory, 1 GiB: 0.27 s for the refit that released them, 0.18 s for the next)."""
    first_patched_bytes: int = 0
    """Of the weights sent as patches, those patched for the first time since their copies were
    made: each side hashes such a copy whole (later patches of it make the digest from the words
    they write), which a steady refit of patches does not pay (on cuda_ipc, host memory, 1 GiB
    at 0.1% changed: 0.17 s for the first refit of patches, 0.11-0.13 s for the next ones)."""


class CostModel:
    """One stream's refit times, fitted (module docstring): a refit's seconds as ``whole x
    B_whole + patched x B_patched + changed x C``. Each part is learnt from the refits that
    sent mostly its kind (the minor parts predicted and taken off first), so that what is
    known of one kind is kept, not forgotten, while a stream sends only another (aged by the
    stream's refits, it gives way to what the kind's next refit teaches): the whole
    part from refits of weights sent whole and untracked (what the choice compares a patch
    with), or, until there is such a refit, from refits of weights sent whole and tracked
    (the first refit's page faults included: an upper bound); the patched part from refits
    of patches, each copy's first patch not counted (it hashes the copy whole on both sides:
    :attr:`RefitCosts.first_patched_bytes`).

    With no refit of untracked weights yet, a weight's whole time is taken as :data:`EXPLORE`
    of that upper bound: a patch predicted to cost more goes whole and untracked, which
    measures the whole part (the first refit of a stream copies every weight and faults its
    memory in: its time says little of a refit that does not).
    ``per_byte_whole``, ``per_byte_patched`` (seconds per byte) and ``per_changed`` (seconds
    per element) are the fitted costs, ``None`` until measured."""

    def __init__(self) -> None:
        self._untracked = np.zeros(2)  # decayed sums: seconds, GB
        self._tracked = np.zeros(2)
        self._gram = np.zeros((2, 2))  # patched part: decayed sums of x x^T and x y, x = (GB, G elements)
        self._moment = np.zeros(2)
        self._evidence = {"untracked": 0, "tracked": 0, "patched": 0}
        self._lessons = {"untracked": 0, "tracked": 0, "patched": 0}  # refits learnt from, by kind
        # The patched fit of the refits added so far, solved once for all the choices of the
        # next refit (a solve costs more than the rest of a weight's choice): (fit,) or None.
        self._fitted: tuple[np.ndarray | None] | None = None
        self._surprised = False  # the last refit learnt from took longer than SURPRISE allows
        self._refits = 0  # added so far
        self._learnt_at: dict[str, int] = {}  # kind -> the refit (count) that taught it last
        self._unpatched = 0  # refits in a row that taught the patched part nothing (outside rechecks)
        self._recheck_after = RECHECK_AFTER
        self._recheck_left = 0  # refits of the recheck under way still to come (0: none)

    def add(self, refit: RefitCosts) -> None:
        """One refit's measurement: it teaches the part of the kind it sent most bytes of (a
        refit mostly of copies freed or patched for the first time teaches nothing), as at most
        :data:`SURPRISE` times what the model predicts for it unless the refit learnt from
        before it took longer than that too. What that part learnt before is aged by
        :data:`DECAY` per refit of the stream since. Counts toward the next recheck."""
        self._refits += 1
        kind = self._learn(refit)
        if kind == "patched":
            if not self._recheck_left:  # patches pay again of their own accord
                self._recheck_after = RECHECK_AFTER
            self._recheck_left = self._unpatched = 0
        elif self._recheck_left:
            self._recheck_left -= 1
        elif self._patched_fit() is not None:
            self._unpatched += 1
            if self._unpatched >= self._recheck_after:
                self._recheck_left, self._unpatched = _RECHECK_REFITS, 0
                self._recheck_after = min(2 * self._recheck_after, RECHECK_AFTER_MAX)

    def _learn(self, refit: RefitCosts) -> str | None:
        """:meth:`add`'s lesson: the kind ``refit`` taught (``None``: none)."""
        parts = {
            "untracked": refit.untracked_bytes - refit.released_bytes,
            "tracked": refit.tracked_bytes,
            "patched": refit.patched_bytes - refit.first_patched_bytes,
            "released": refit.released_bytes,
            "first patched": refit.first_patched_bytes,
        }
        kind = max(parts, key=lambda key: parts[key])
        if refit.seconds <= 0 or parts[kind] == 0 or kind in _ONE_TIME:  # not what a steady refit pays
            return None
        predicted = {key: self._predicted(key, refit) for key in ("untracked", "tracked", "patched")}
        seconds, expected = refit.seconds, sum(predicted.values())
        surprising = predicted[kind] > 0 and seconds > SURPRISE * expected
        if surprising and not self._surprised:  # learnt as the most the fit allows, until it repeats
            seconds = SURPRISE * expected
        self._surprised = surprising
        seconds = max(0.0, seconds - sum(part for key, part in predicted.items() if key != kind))
        age = DECAY ** min(self._refits - self._learnt_at.get(kind, self._refits - 1), _AGE_LIMIT)
        self._learnt_at[kind] = self._refits
        if kind == "patched":
            x = np.array([refit.patched_bytes, refit.changed_elements]) / _GB
            self._gram = age * self._gram + np.outer(x, x)
            self._moment = age * self._moment + x * seconds
        else:
            sums = self._untracked if kind == "untracked" else self._tracked
            sums *= age
            sums += (seconds, parts[kind] / _GB)
        self._evidence[kind] += parts[kind]
        self._lessons[kind] += 1
        self._fitted = None
        return kind

    def _predicted(self, kind: str, refit: RefitCosts) -> float:
        """The seconds the fit so far gives the part of ``refit`` of ``kind`` (0 unknown)."""
        if kind == "patched":
            fit = self._patched_fit()
            return 0.0 if fit is None else float(fit @ np.array([refit.patched_bytes, refit.changed_elements])) / _GB
        rate = self._whole_rate(kind)
        return 0.0 if rate is None else rate * (refit.untracked_bytes if kind == "untracked" else refit.tracked_bytes)

    def _whole_rate(self, kind: str) -> float | None:
        sums = self._untracked if kind == "untracked" else self._tracked
        if self._evidence[kind] < MIN_EVIDENCE_BYTES or sums[1] <= 0:
            return None
        return float(sums[0] / sums[1]) / _GB

    def _patched_fit(self) -> np.ndarray | None:
        """(seconds per GB patched, seconds per G elements changed), held near the prior
        (``None`` until measured). Solved once per :meth:`add`; not to be modified."""
        if self._fitted is None:
            self._fitted = (self._solve_patched(),)
        return self._fitted[0]

    def _solve_patched(self) -> np.ndarray | None:
        if self._evidence["patched"] < MIN_EVIDENCE_BYTES:
            return None
        ridge = _PRIOR_STRENGTH * np.diag(np.diag(self._gram) + 1e-12)  # relative: the features' scales differ
        return np.maximum(np.linalg.solve(self._gram + ridge, self._moment + ridge @ _PRIOR), 0.0)

    @property
    def per_byte_whole(self) -> float | None:
        """Seconds per byte sent whole and untracked (else tracked: an upper bound)."""
        untracked = self._whole_rate("untracked")
        return untracked if untracked is not None else self._whole_rate("tracked")

    @property
    def per_byte_patched(self) -> float | None:
        fit = self._patched_fit()
        return None if fit is None else float(fit[0]) / _GB

    @property
    def per_changed(self) -> float | None:
        fit = self._patched_fit()
        return None if fit is None else float(fit[1]) / _GB

    def releases(self, nbytes: int, numel: int, fraction: float) -> bool:
        """Whether a tracked weight of ``nbytes`` and ``numel`` elements, of which ``fraction``
        changed at its last comparison, is to be released and watched: predicted to take no
        longer whole (:meth:`_whole_seconds`) than as a patch (``False`` until both are known:
        the choice is then by bytes; and until :data:`MIN_PATCHED_REFITS` refits of patches
        were learnt from)."""
        if self._lessons["patched"] < MIN_PATCHED_REFITS:
            return False
        share = self.patch_share(nbytes, numel, fraction)
        return share is not None and share >= 1 and not (self._recheck_left and share <= RECHECK)

    def rechecks(self, nbytes: int, numel: int, fraction: float) -> bool:
        """Whether a watched weight that :meth:`retracks` leaves watched is tracked again for
        a recheck of the patched part (module docstring): one is starting, and its patch is
        predicted to take at most :data:`RECHECK` of its whole time. Kept until the recheck
        ends: :meth:`releases` spares it (and any tracked weight within that share) meanwhile."""
        if self._recheck_left != _RECHECK_REFITS:
            return False
        share = self.patch_share(nbytes, numel, fraction)
        return share is not None and share <= RECHECK

    def patch_share(self, nbytes: int, numel: int, fraction: float) -> float | None:
        """The time a patch of such a weight is predicted to take, as a share of its whole time
        (:meth:`_whole_seconds`; ``math.inf`` where whole weights cost nothing measurable,
        ``None`` until both are known)."""
        patch, whole = self._patch_seconds(nbytes, numel, fraction), self._whole_seconds(nbytes)
        if patch is None or whole is None:
            return None
        return patch / whole if whole > 0 else math.inf

    def retracks(self, nbytes: int, numel: int, fraction: float, *, margin: float = RETRACK) -> bool:
        """Whether a watched weight whose patch would be fewer bytes (``fraction`` of it changed
        since the last refit, by its sample) is to be tracked again: its patch predicted to
        take at most ``margin`` of its whole time (:meth:`_whole_seconds`; ``True`` until
        both are known: the choice is then by bytes)."""
        patch, whole = self._patch_seconds(nbytes, numel, fraction), self._whole_seconds(nbytes)
        return patch is None or whole is None or bool(patch <= margin * whole)

    @property
    def knows_whole(self) -> bool:
        """Whether a refit of untracked weights was learnt: whole weights' cost is measured,
        not :data:`EXPLORE`'s bound."""
        return self._whole_rate("untracked") is not None

    def _whole_seconds(self, nbytes: int) -> float | None:
        """``nbytes`` sent whole and untracked: at the untracked rate, or, with none measured
        yet, at :data:`EXPLORE` of the tracked rate (``None`` with neither)."""
        untracked = self._whole_rate("untracked")
        if untracked is not None:
            return untracked * nbytes
        tracked = self._whole_rate("tracked")
        return None if tracked is None else EXPLORE * tracked * nbytes

    def _patch_seconds(self, nbytes: int, numel: int, fraction: float) -> float | None:
        fit = self._patched_fit()
        if fit is None:
            return None
        patched, changed = fit / _GB
        return float(patched * nbytes + changed * fraction * numel)
