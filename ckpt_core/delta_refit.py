"""Delta refits' two stages: the sender's, which sends each weight as a patch against what its
destination holds where that pays, and the receiver's, which turns the patches back into whole
weights. Both sit above the pipeline (as layouts and quantize-on-send do), one pair per
destination stream; the patches are :mod:`ckpt_core.delta`'s.

Each side keeps a :class:`Baseline`: a copy of the weights of the last refit it completed, with
that refit's version (a token the sender draws for each refit). A refit through
:meth:`DeltaSender.encode` and :meth:`DeltaReceiver.decode` carries, first, a manifest naming
the version its patches were made against and the version it makes; then each weight either
whole under its own name (both sides keep a copy); or as a patch, under ``<name>`` +
:data:`PATCH_SUFFIX`: the patch's wire form (:func:`ckpt_core.delta.compare`: the new weight's
digest, its positions, its values); or whole under ``<name>`` + :data:`UNTRACKED_SUFFIX`, a
weight neither side keeps a copy of.

**The choice, weight by weight.** A patch is sent where it pays: the sender measures, as it
goes, how fast it compares weights and how fast its link moves bytes (its refits' own
statistics), and each weight's changed fraction at its last comparison. A weight whose patch
those predict to take longer than sending it whole, or whose comparison found no patch fewer
bytes, is sent whole and untracked (no copy on either side: copying it would cost more than it
saves) for a rest of refits, then whole and tracked again, then compared again; the rest
doubles each time the weight is found not to pay (up to :data:`MAX_REST` refits) and ends with
its next patch. Every choice is counted in the refit's :class:`~ckpt_core.stats.RefitStats`.

What it guarantees:

* a patch applies only to the version it was made against: a receiver holding another (a
  new or restarted one, one that missed or failed a refit) refuses the refit at its manifest,
  before any weight, with :class:`BaselineMismatchError`, and keeps what it holds; a refit
  made against no version (every weight whole) is taken by any receiver;
* every patched weight is checked against the sender's digest of the new weight
  (:class:`~ckpt_core.errors.IntegrityError` naming it on a mismatch);
* a baseline moves only with :meth:`~DeltaSender.commit`, which a side calls once its refit
  completed: a refit that failed anywhere leaves both baselines as they were (the sender's
  copies, patched as it compared them, are put back). A sender that cannot know whether its
  destination completed (it failed, or its destination reports another version when they meet
  again) calls :meth:`~DeltaSender.forget`, and its next refit sends every weight whole.

What it costs: each side holds a copy of every weight it tracks (its :attr:`Baseline.nbytes`);
the sender compares each weight with its copy (one pass over both, in which the copy is
patched and the new weight hashed) and copies each weight it sends whole and tracked; the
receiver patches its copy and hashes it (one pass) and copies each weight received whole and
tracked. A sender given ``max_baseline_bytes`` keeps copies of the weights that fit in it, in
the order it sends them (the same weights every refit where the order and shapes stay), and
sends the rest whole and untracked, so that its destination keeps no copy of them either: each
side's baseline of one stream stays within that bound.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import torch

from ckpt_core.delta import Patch, apply, apply_and_digest, can_pay, compare, copy_bits, decode, encoded_bytes
from ckpt_core.errors import IntegrityError, LifecycleError, WireFormatError
from ckpt_core.stats import RefitStats

MANIFEST_NAME = "\x00ckpt-engine.delta"
"""The name of a delta refit's first entry (a ``uint8`` tensor of JSON); no weight has it."""
PATCH_SUFFIX = "\x00patch"
"""Appended to a weight's name when it travels as a patch."""
UNTRACKED_SUFFIX = "\x00untracked"
"""Appended to a weight's name when it travels whole and neither side keeps a copy of it."""
_FORMAT_VERSION = 3  # 2: untracked weights; 3: leaf digests, patches' values 8-byte aligned
MAX_REST = 16
"""The most refits a weight that does not pay as a patch is sent whole and untracked before it
is tracked (and compared) again."""
MIN_EVIDENCE_BYTES = 64 << 20
"""The bytes a rate must be measured over before the choice uses it."""
_DECAY = 0.5  # the weight of a refit's measurements against the next refit's


class BaselineMismatchError(LifecycleError):
    """A refit's patches were made against a version of the weights the receiver does not hold
    (the message names both): nothing was applied, the receiver keeps what it holds. The
    sender must send every weight whole (``DeltaSender.forget``)."""


@dataclasses.dataclass(frozen=True)
class Baseline:
    """What one side holds of one destination's weights after a completed refit: a copy of
    each (contiguous, owned) and that refit's version (``None``: nothing yet). The copies are
    patched in place by later refits (the sender's at commit, the receiver's as it receives,
    put back if that refit fails), so one ``Baseline`` object is the current one only."""

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    version: str | None = None

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
    names: set[str] = dataclasses.field(default_factory=set)  # every weight encoded, tracked or not
    compared_bytes: int = 0
    compare_seconds: float = 0.0
    complete: bool = False

    def committed(self) -> Baseline:
        """The next baseline: each patched copy (patched already), each whole one's copy."""
        tensors = {}
        for name, entry in self.sent.items():
            tensors[name] = self.base.tensors[name] if isinstance(entry, Patch) else entry
        return Baseline(tensors, self.version)

    def undo(self) -> None:
        """Put back every copy patched so far (newest first)."""
        for name, entry in reversed(self.sent.items()):
            if isinstance(entry, Patch):
                apply(self.base.tensors[name], entry, name=name)
        self.sent.clear()


@dataclasses.dataclass
class _History:
    """What the sender's choice knows of one weight: the changed fraction its last comparison
    found (at least this much where it stopped early; ``None``: not compared since it was
    tracked again), and its rest: ``resting`` refits still to send it whole and untracked, and
    the length of its next rest."""

    fraction: float | None = None
    resting: int = 0
    rest: int = 1

    def start_rest(self) -> None:
        """The weight does not pay as a patch: it goes whole and untracked for this refit and
        ``rest - 1`` more, and its next rest is twice as long (up to ``MAX_REST``); then it is
        tracked again and its fraction measured afresh."""
        self.resting = self.rest - 1
        self.rest = min(MAX_REST, 2 * self.rest)
        self.fraction = None


class Rates:
    """The sender's measured throughputs, in bytes per second, each over its refits so far
    with older refits counting less (halved per refit): ``link``, the bytes its refits moved
    over the time its pipeline ran (a refit's time less its comparisons'); ``compare``, the
    weights' bytes its comparisons read, over their time. Each is ``None`` until it rests on
    :data:`MIN_EVIDENCE_BYTES` (a few small refits' timings are mostly fixed costs)."""

    def __init__(self) -> None:
        self._moved = _Rate()
        self._compared = _Rate()

    @property
    def link(self) -> float | None:
        return self._moved.value

    @property
    def compare(self) -> float | None:
        return self._compared.value

    def refit(self, moved_bytes: int, pipeline_seconds: float, compared_bytes: int, compare_seconds: float) -> None:
        """One refit's measurements."""
        self._moved.add(moved_bytes, pipeline_seconds)
        self._compared.add(compared_bytes, compare_seconds)

    def whole_pays(self, tensor: torch.Tensor, fraction: float) -> bool:
        """Whether sending ``tensor`` whole takes less time than comparing it and sending a
        patch of ``fraction`` of its elements, at these rates (``False`` until both are known:
        the comparison then decides, by bytes)."""
        link, compare_rate = self.link, self.compare
        if link is None or compare_rate is None:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        patch = encoded_bytes(round(fraction * tensor.numel()), tensor.numel(), tensor.element_size())
        return nbytes / link <= nbytes / compare_rate + patch / link


@dataclasses.dataclass
class _Rate:
    """Bytes over seconds, each refit's sums halving the weight of those before."""

    nbytes: float = 0.0
    seconds: float = 0.0
    evidence: int = 0  # bytes measured in all, not decayed

    def add(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.nbytes = _DECAY * self.nbytes + nbytes
            self.seconds = _DECAY * self.seconds + seconds
            self.evidence += nbytes

    @property
    def value(self) -> float | None:
        return self.nbytes / self.seconds if self.evidence >= MIN_EVIDENCE_BYTES else None


def _comparable(old: torch.Tensor, new: torch.Tensor) -> bool:
    return (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)


class DeltaSender:
    """The sender's stage for one destination stream (``destination`` names it in errors),
    keeping at most ``max_baseline_bytes`` of copies (``None``: every weight; module docstring)."""

    def __init__(self, *, destination: str, max_baseline_bytes: int | None = None) -> None:
        self.destination = destination
        self.max_baseline_bytes = max_baseline_bytes
        self.baseline = Baseline()
        self.rates = Rates()
        """What the choice between patches and whole weights is made with."""
        self._history: dict[str, _History] = {}
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
        stats.delta_link_gbps = (self.rates.link or 0.0) / 1e9
        stats.delta_compare_gbps = (self.rates.compare or 0.0) / 1e9
        yield MANIFEST_NAME, _manifest(base.version, pending.version)
        tracked_bytes = 0
        for name, tensor in weights:
            if name in pending.names:
                raise WireFormatError(f"{self.destination}: the sender yields weight {name!r} twice in one refit")
            pending.names.add(name)
            stats.delta_tensors += 1
            if not can_pay(tensor):
                stats.untracked_tensors += 1
                stats.chosen_whole_tensors += 1
                yield name + UNTRACKED_SUFFIX, tensor
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if self.max_baseline_bytes is not None and tracked_bytes + nbytes > self.max_baseline_bytes:
                stats.untracked_tensors += 1
                yield name + UNTRACKED_SUFFIX, tensor
                continue
            tracked_bytes += nbytes  # its place in the bound, kept while it rests
            if self._chooses_whole(name, tensor):
                stats.untracked_tensors += 1
                stats.chosen_whole_tensors += 1
                yield name + UNTRACKED_SUFFIX, tensor
                continue
            history = self._history.setdefault(name, _History())
            old = base.tensors.get(name)
            if old is None or not _comparable(old, tensor):  # new, reshaped, or tracked again after a rest
                history.fraction = None
                pending.sent[name] = copy_bits(tensor.detach())
                stats.whole_tensors += 1
                yield name, tensor
                continue
            start = time.perf_counter()
            found = compare(old, tensor, name=name, encoded=True, update=True)
            pending.compare_seconds += time.perf_counter() - start
            pending.compared_bytes += found.compared * tensor.element_size()
            history.fraction = found.changed / max(1, found.compared)
            if found.patch is None:  # no patch is fewer bytes: whole, and untracked for a rest
                history.start_rest()
                stats.untracked_tensors += 1
                stats.chosen_whole_tensors += 1
                yield name + UNTRACKED_SUFFIX, tensor
                continue
            assert found.undo is not None and found.encoded is not None
            history.rest = 1
            pending.sent[name] = found.undo
            _count_patch(stats, found.patch, tensor)
            yield name + PATCH_SUFFIX, found.encoded
        stats.delta_seconds += pending.compare_seconds
        pending.complete = True

    def _chooses_whole(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``name`` goes whole and untracked by the choice this refit: it rests, or
        its last changed fraction makes a patch predicted slower than the whole weight (which
        starts a rest)."""
        history = self._history.get(name)
        if history is None:
            return False
        if history.resting:
            history.resting -= 1
            return True
        if history.fraction is not None and self.rates.whole_pays(tensor, history.fraction):
            history.start_rest()
            return True
        return False

    def commit(self, stats: RefitStats | None = None) -> None:
        """The refit :meth:`encode` made completed at its destination: its weights are the
        baseline now. ``stats``, the refit's own account of this stream, feeds the link rate
        the next refits choose with. Refused (``LifecycleError``) without a refit encoded to its
        end."""
        pending = self._pending
        if pending is None or not pending.complete:
            raise LifecycleError(f"{self.destination}: no encoded refit to commit")
        self._pending = None
        self.baseline = pending.committed()
        self._history = {name: history for name, history in self._history.items() if name in pending.names}
        if stats is not None:
            pipeline_seconds = stats.seconds - pending.compare_seconds
            self.rates.refit(stats.payload_bytes, pipeline_seconds, pending.compared_bytes, pending.compare_seconds)

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
    next refit's manifest, before a commit) puts the baseline back bit for bit."""

    def __init__(self, *, source: str) -> None:
        self.source = source
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
        on as received (this keeps a copy, unless it came untracked); a patched one is the
        baseline's copy, patched in place and checked, which the caller reads (or copies) and
        must not write to: the next refit patches it again (a write is caught then, by the
        digest check)."""
        if self._refit is None or self._ended or name == MANIFEST_NAME:  # a manifest starts a refit
            self.discard()  # what an abandoned refit patched is put back first
            if name != MANIFEST_NAME:
                raise WireFormatError(f"a delta refit from {self.source} starts with its manifest, got {name!r}")
            base_version, version = _read_manifest(tensor, self.source)
            if base_version is not None and base_version != self.baseline.version:
                raise BaselineMismatchError(
                    f"{self.source} made this refit's patches against weights version {base_version}, but this "
                    f"receiver holds {self.baseline.version}: nothing was applied; the sender must send every "
                    "weight whole"
                )
            base = self.baseline if base_version is not None else Baseline()  # a whole refit patches nothing
            self._refit = _Receiving(base, version)
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
            refit.kept[name] = copy_bits(tensor.detach())
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
        self.baseline = Baseline(self._refit.kept, self._refit.version)
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
    it kept, those it passed on untracked, and the values its patches overwrote (newest last)."""

    base: Baseline
    version: str
    kept: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    untracked: set[str] = dataclasses.field(default_factory=set)
    overwritten: list[tuple[str, torch.Tensor, Patch]] = dataclasses.field(default_factory=list)

    def patch(self, name: str, held: torch.Tensor, patch: Patch, digest: int, *, source: str) -> None:
        """Apply ``patch`` to ``held`` in place, keeping the values it overwrites, and check
        the result against the sender's ``digest``."""
        undo, found = apply_and_digest(held, patch, name=name)
        self.overwritten.append((name, held, undo))
        self.kept[name] = held
        if found != digest:
            raise IntegrityError(
                f"{name}: patched from {source}'s patch, it does not match the sender's digest of the "
                "new weight: this receiver's copy differs from the sender's"
            )

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

    def __init__(self, *, max_baseline_bytes: int | None = None) -> None:
        self.max_baseline_bytes = max_baseline_bytes  # each sender's bound
        self.senders: dict[tuple[int, ...], DeltaSender] = {}
        self.receiver = DeltaReceiver(source="the policy")

    def metadata(self) -> dict[str, str | None]:
        return {self.METADATA_KEY: self.receiver.baseline.version}

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


def _manifest(base: str | None, version: str) -> torch.Tensor:
    data = json.dumps({"format": "ckpt-engine.delta", "version": _FORMAT_VERSION, "base": base, "makes": version})
    return torch.frombuffer(bytearray(data.encode()), dtype=torch.uint8)


def _read_manifest(tensor: torch.Tensor, source: str) -> tuple[str | None, str]:
    try:
        data = json.loads(bytes(tensor.cpu().numpy().tobytes()))
        if data["format"] != "ckpt-engine.delta" or data["version"] != _FORMAT_VERSION:
            raise ValueError(
                f"format {data['format']!r} version {data['version']!r}, this ckpt-core reads version "
                f"{_FORMAT_VERSION}: give both sides the same ckpt-core"
            )
        base, makes = data["base"], data["makes"]
        if not (base is None or isinstance(base, str)) or not isinstance(makes, str):
            raise ValueError("base and makes must be version strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise WireFormatError(f"the delta manifest from {source} is malformed: {exc}") from None
    return base, makes
