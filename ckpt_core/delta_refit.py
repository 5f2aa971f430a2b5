"""Delta refits' two stages: the sender's, which sends each weight as a patch against what its
destination holds where that is fewer bytes, and the receiver's, which turns the patches back
into whole weights. Both sit above the pipeline (as layouts and quantize-on-send do), one pair
per destination stream; the patches are :mod:`ckpt_core.delta`'s.

Each side keeps a :class:`Baseline`: a copy of every weight of the last refit it completed,
with that refit's version (a token the sender draws for each refit). A refit through
:meth:`DeltaSender.encode` and :meth:`DeltaReceiver.decode` carries, first, a manifest naming
the version its patches were made against and the version it makes; then each weight either
whole, under its own name, or, where that is fewer bytes, as a patch, under ``<name>`` +
:data:`PATCH_SUFFIX`: one ``uint8`` tensor holding the new weight's digest (8 bytes,
little-endian), the patch's positions and its values (the receiver knows their widths from
its copy of the weight); or, past the sender's baseline bound, whole under ``<name>`` +
:data:`UNTRACKED_SUFFIX`: a weight neither side keeps a copy of.

What it guarantees:

* a patch applies only to the version it was made against: a receiver holding another (a
  new or restarted one, one that missed or failed a refit) refuses the refit at its manifest,
  before any weight, with :class:`BaselineMismatchError`, and keeps what it holds; a refit
  made against no version (every weight whole) is taken by any receiver;
* every patched weight is checked against the sender's digest of the new weight
  (:class:`~ckpt_core.errors.IntegrityError` naming it on a mismatch);
* a baseline moves only with :meth:`~DeltaSender.commit`, which a side calls once its refit
  completed: a refit that failed anywhere leaves both baselines as they were. A sender that
  cannot know whether its destination completed (it failed, or its destination reports
  another version when they meet again) calls :meth:`~DeltaSender.forget`, and its next refit
  sends every weight whole.

What it costs: each side holds a copy of every weight it sent or received (its
:attr:`Baseline.nbytes`), and the sender compares each weight with its copy (``diff``) and
copies it (the next baseline). A sender given ``max_baseline_bytes`` keeps copies of the
weights that fit in it, in the order it sends them (the same weights every refit where the
order and shapes stay), and sends the rest whole and untracked, so that its destination keeps
no copy of them either: each side's baseline of one stream stays within that bound.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import uuid
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import torch

from ckpt_core._internal.checksum import payload_checksum
from ckpt_core._internal.device_checksum import device_payload_checksum
from ckpt_core.delta import Patch, apply, copy_bits, diff, patchable, position_dtype, reverse
from ckpt_core.errors import IntegrityError, LifecycleError, WireFormatError
from ckpt_core.stats import RefitStats

MANIFEST_NAME = "\x00ckpt-engine.delta"
"""The name of a delta refit's first entry (a ``uint8`` tensor of JSON); no weight has it."""
PATCH_SUFFIX = "\x00patch"
"""Appended to a weight's name when it travels as a patch."""
UNTRACKED_SUFFIX = "\x00untracked"
"""Appended to a weight's name when it travels whole and neither side keeps a copy of it."""
_FORMAT_VERSION = 2  # 2: untracked weights
_DIGEST = struct.Struct("<Q")


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


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A sender's encoded refit awaiting its commit: the baseline it was made against, and,
    per weight, its copy (sent whole) or its patch."""

    base: Baseline
    sent: dict[str, torch.Tensor | Patch]
    version: str

    def applied(self) -> Baseline:
        tensors = {}
        for name, entry in self.sent.items():
            if isinstance(entry, Patch):
                tensor = self.base.tensors[name]
                apply(tensor, entry, name=name)
                entry = tensor
            tensors[name] = entry
        return Baseline(tensors, self.version)


def tensor_digest(tensor: torch.Tensor) -> int:
    """A 64-bit digest of ``tensor``'s bytes (xxh3 on the host, ckpt-engine's device digest
    elsewhere): what a patched weight is checked against."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    return payload_checksum(data) if data.device.type == "cpu" else device_payload_checksum(data)


def _comparable(old: torch.Tensor, new: torch.Tensor) -> bool:
    return (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)


class DeltaSender:
    """The sender's stage for one destination stream (``destination`` names it in errors),
    keeping at most ``max_baseline_bytes`` of copies (``None``: every weight; module docstring)."""

    def __init__(self, *, destination: str, max_baseline_bytes: int | None = None) -> None:
        self.destination = destination
        self.max_baseline_bytes = max_baseline_bytes
        self.baseline = Baseline()
        self._pending: _Pending | None = None

    def encode(
        self, weights: Iterable[tuple[str, torch.Tensor]], stats: RefitStats
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """``weights`` as this refit sends them: the manifest, then each weight whole or as a
        patch against the baseline, counted into ``stats`` (its delta fields) as they go. The
        weights become the next baseline at :meth:`commit`: a copy of each weight sent whole,
        each patch kept until then (the caller may change its weights once they were sent);
        weights past ``max_baseline_bytes`` go whole and untracked."""
        base = self.baseline
        version = uuid.uuid4().hex
        yield MANIFEST_NAME, _manifest(base.version, version)
        sent: dict[str, torch.Tensor | Patch] = {}
        untracked: set[str] = set()
        tracked_bytes = 0
        self._pending = None
        for name, tensor in weights:
            if name in sent or name in untracked:
                raise WireFormatError(f"{self.destination}: the sender yields weight {name!r} twice in one refit")
            nbytes = tensor.numel() * tensor.element_size()
            if self.max_baseline_bytes is not None and tracked_bytes + nbytes > self.max_baseline_bytes:
                stats.delta_tensors += 1
                untracked.add(name)
                yield name + UNTRACKED_SUFFIX, tensor
                continue
            tracked_bytes += nbytes
            old = base.tensors.get(name)
            patch = None
            if old is not None and _comparable(old, tensor) and patchable(tensor):
                patch = diff(old, tensor, name=name)
            stats.delta_tensors += 1
            blob = None if patch is None else _patch_blob(tensor_digest(tensor), patch)
            if patch is None or blob is None or blob.numel() >= tensor.numel() * tensor.element_size():
                sent[name] = copy_bits(tensor.detach())  # the patch, its 8-byte digest included, is no smaller
                yield name, tensor
            else:
                sent[name] = patch
                _count_patch(stats, patch, tensor)
                yield name + PATCH_SUFFIX, blob
        self._pending = _Pending(base, sent, version)

    def commit(self) -> None:
        """The refit :meth:`encode` made completed at its destination: its weights are the
        baseline now (patches applied to the baseline's copies in place). Refused
        (``LifecycleError``) without a refit encoded to its end."""
        if self._pending is None:
            raise LifecycleError(f"{self.destination}: no encoded refit to commit")
        pending, self._pending = self._pending, None
        try:
            self.baseline = pending.applied()
        except BaseException:
            self.forget()  # a copy half patched is no baseline
            raise

    def discard(self) -> None:
        """The refit failed at its destination (or before): the baseline stays."""
        self._pending = None

    def forget(self) -> None:
        """Whether the destination holds the baseline is unknown: drop it (the next refit
        sends every weight whole)."""
        self.baseline, self._pending = Baseline(), None


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
        on as received (this keeps a copy); a patched one is the baseline's copy, patched in
        place and checked, which the caller reads (or copies) and must not write to: the next
        refit patches it again (a write is caught then, by the digest check)."""
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
        if name.endswith(UNTRACKED_SUFFIX):  # past the sender's bound: no copy kept
            refit.untracked.add(weight)
            return weight, tensor
        if not name.endswith(PATCH_SUFFIX):
            refit.kept[name] = copy_bits(tensor.detach())
            return name, tensor
        name = name.removesuffix(PATCH_SUFFIX)
        held = refit.base.tensors.get(name)
        if held is None:
            raise WireFormatError(f"{self.source} sent a patch of {name!r}, which this receiver does not hold")
        patch, digest = _read_patch(tensor, held, name)
        refit.patch(name, held, patch)
        if tensor_digest(held) != digest:
            raise IntegrityError(
                f"{name}: patched from {self.source}'s patch, it does not match the sender's digest of the "
                "new weight: this receiver's copy differs from the sender's"
            )
        _count_patch(stats, patch, held)
        return name, held

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

    def patch(self, name: str, held: torch.Tensor, patch: Patch) -> None:
        """Apply ``patch`` to ``held`` in place, keeping the values it overwrites."""
        self.overwritten.append((name, held, reverse(held, patch, name=name)))
        self.kept[name] = held
        apply(held, patch, name=name)

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

    def commit_senders(self) -> None:
        for sender in self.senders.values():
            sender.commit()

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


def _patch_blob(digest: int, patch: Patch) -> torch.Tensor:
    """A patch as one ``uint8`` tensor: the digest, the positions, the values."""
    values = patch.values.contiguous().reshape(-1)
    values = values.view(torch.uint8) if values.dtype == torch.bool else values
    header = torch.frombuffer(bytearray(_DIGEST.pack(digest)), dtype=torch.uint8).to(values.device)
    return torch.cat([header, patch.positions.view(torch.uint8), values.view(torch.uint8)])


def _read_patch(blob: torch.Tensor, like: torch.Tensor, name: str) -> tuple[Patch, int]:
    """The patch (and the sender's digest) in ``blob``, for a weight like ``like``."""
    numel, width = like.numel(), like.element_size()
    positions_dtype = position_dtype(numel)
    per_element = torch.empty((), dtype=positions_dtype).element_size() + width
    body = blob.numel() - _DIGEST.size
    if blob.dtype != torch.uint8 or blob.dim() != 1 or body < 0 or body % per_element:
        raise WireFormatError(
            f"{name}: a patch of {blob.numel()} bytes does not hold whole elements of {like.dtype} with their positions"
        )
    count = body // per_element
    (digest,) = _DIGEST.unpack(blob[: _DIGEST.size].cpu().numpy().tobytes())
    data = blob[_DIGEST.size :].to(like.device)
    positions = data[: count * (per_element - width)].clone().view(positions_dtype)
    values = data[count * (per_element - width) :].clone()
    values = values.view(torch.bool) if like.dtype == torch.bool else values.view(like.dtype)
    return Patch(positions=positions, values=values, numel=numel), digest
