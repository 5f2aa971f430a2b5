"""Plain records describing a refit, passed to hooks and returned by coordinators."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Literal

Role = Literal["policy", "rollout"]


@dataclasses.dataclass(frozen=True)
class RefitContext:
    """Which worker is in which refit."""

    backend: str
    role: Role
    rank: int
    refit_index: int


@dataclasses.dataclass
class RefitStats:
    """One worker's account of one refit. Times are wall-clock seconds."""

    payload_bytes: int = 0
    """Tensor bytes moved (not counting alignment padding or headers)."""
    tensors: int = 0
    buckets: int = 0
    direct_chunks: int = 0
    """Chunks moved outside the bucket buffers, straight between a weight and its output
    tensor (transports with ``direct_chunks``, for chunks of 1 MiB and more)."""
    handed_over_buckets: int = 0
    """Receiver: buckets of small whole tensors received owned whose transport handed its
    buffer's memory over (``BucketReceiver.hand_over``): their tensors are views of it, nothing
    copied out of a slot."""
    replayed_tensors: int = 0
    """Sender: tensors copied to the place they had in the last refit's layout, which this one
    repeated (nothing laid out or described again); the rest were laid out afresh."""
    seconds: float = 0.0
    pack_seconds: float = 0.0
    """Sender: copying chunks into bucket buffers. Receiver: 0."""
    transfer_seconds: float = 0.0
    """Time spent waiting on the transport (the part not hidden by double buffering)."""
    unpack_seconds: float = 0.0
    """Receiver: reassembling tensors from buckets. Sender: 0."""
    checksum_seconds: float = 0.0
    delta_tensors: int = 0
    """Delta refits (the ``delta`` option): the refit's weights, whole or as patches
    (``tensors`` counts what moved, the refit's manifest too). 0 without delta."""
    patched_tensors: int = 0
    """Delta refits: the weights that moved as patches (the rest of ``delta_tensors`` whole)."""
    patched_elements: int = 0
    """Delta refits: the elements of the weights that moved as patches."""
    changed_elements: int = 0
    """Delta refits: of ``patched_elements``, those whose bits changed (what the patches carry)."""
    whole_tensors: int = 0
    """Delta refits: the weights that moved whole and are kept as the next baseline (new to the
    stream, changed in shape or dtype, elements not comparable, or tracked again after a rest)."""
    untracked_tensors: int = 0
    """Delta refits: the weights that moved whole and neither side keeps (past
    ``delta_max_baseline_bytes``, or sent whole by the choice): ``delta_tensors`` is
    ``patched_tensors + whole_tensors + untracked_tensors``."""
    chosen_whole_tensors: int = 0
    """Delta refits, sender: of ``untracked_tensors``, those the choice sent whole: no patch of
    them can be fewer bytes, or theirs was found no fewer bytes or predicted slower than the
    whole weight (by the costs below), or they rest since it was (ckpt_core.refit.delta.choice)."""
    rechecked_tensors: int = 0
    """Delta refits, sender: of ``whole_tensors``, those tracked again although their patches
    were not predicted to pay, to measure them anew (a recheck: ckpt_core.refit.delta.choice)."""
    delta_seconds: float = 0.0
    """Delta refits: the sender's time comparing weights with its copies (patching them and
    hashing the new weights in the same pass); the receiver's, patching and checking."""
    delta_whole_gbps: float = 0.0
    """Delta refits, sender: what the choice between patches and whole weights expected of a
    weight sent whole, in GB/s of its bytes, from this stream's refit times so far
    (:mod:`ckpt_core.refit.delta.choice`; 0.0 until measured). Combined over streams: the highest."""
    delta_patched_gbps: float = 0.0
    """Delta refits, sender: the same for a weight sent as a patch, before its changed
    elements' cost."""
    delta_changed_ns: float = 0.0
    """Delta refits, sender: the cost the choice expected of each changed element (ns)."""

    @classmethod
    def combined(cls, parts: Iterable[RefitStats]) -> RefitStats:
        """One worker's account of a refit sent as several streams at once: counts and bytes
        summed, ``seconds`` the longest stream's, the choice's costs the highest, the other
        times summed over the streams."""
        total = cls()
        for part in parts:
            for field in dataclasses.fields(cls):
                value = getattr(part, field.name)
                if field.name == "seconds" or field.name.endswith(("_gbps", "_ns")):
                    setattr(total, field.name, max(getattr(total, field.name), value))
                else:
                    setattr(total, field.name, getattr(total, field.name) + value)
        return total

    @property
    def gbps(self) -> float:
        """Payload throughput in GB/s (1e9 bytes per second)."""
        return self.payload_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def fraction_patched(self) -> float:
        """Delta refits: the fraction of the weights that moved as patches (0.0 without delta)."""
        return self.patched_tensors / self.delta_tensors if self.delta_tensors else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gbps": self.gbps, "fraction_patched": self.fraction_patched}
