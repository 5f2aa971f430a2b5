"""An in-process transport: the shared bucket pipeline over two shared buffers.

A reference for transport authors (the smallest complete ``BucketSender`` / ``BucketReceiver``
pair, with deadlines and peer loss) and a tool for tests of code that drives an engine: a
refit through it runs the real lifecycle, pipeline, hooks and statistics without processes.

One sender and one receiver in the same process share ``num_slots`` slot buffers, the way a
shared-memory transport would: the sender packs a slot and posts its header on a queue, the
receiver reads the payload straight from the same slot, and the sender may not repack a slot
until the receiver has released it. A pipeline that read a slot after releasing it, or packed
one still in use, would corrupt tensors, which the tests' bit-exact checks would catch.

Every wait has a deadline (``TransferTimeoutError``); closing either side wakes the other
with ``PeerLostError``. ``InProcessLink.corrupt`` flips payload bytes as they "arrive", to test
integrity checks.

``InProcessEngine`` wraps it as a ``BucketedEngine`` (one policy rank, one rollout rank, one
process), named ``"ckpt_core.testing.in_process:InProcessEngine"`` wherever a backend is;
:func:`connected_pair` and :func:`run_refit` run a refit through it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from ckpt_core.errors import PeerLostError, TransferTimeoutError
from ckpt_core.transport import BucketReceiver, BucketSender, Option
from ckpt_core.transport.capabilities import BackendCapabilities
from ckpt_core.transport.engine import BucketedEngine


class InProcessLink:
    """What one sender and its receiver share."""

    def __init__(self, bucket_size: int, num_slots: int = 2) -> None:
        self.buffers = [torch.empty(bucket_size, dtype=torch.uint8) for _ in range(num_slots)]
        self.corrupt: dict[int, int] = {}
        """Bucket index -> payload byte the receiver finds flipped."""
        self.posted: list[tuple[int, int]] = []
        """(slot, nbytes) of every post, in order."""
        self._headers: queue.Queue[tuple[bytes, int, int, tuple[torch.Tensor, ...]] | None] = queue.Queue()
        self._busy = [False] * num_slots
        self._closed_by: str | None = None
        self._cond = threading.Condition()

    def post(self, slot: int, header: bytes, nbytes: int, direct: tuple[torch.Tensor, ...] = ()) -> None:
        with self._cond:
            if self._closed_by is not None:
                raise PeerLostError(f"the {self._closed_by} closed the link")
            if self._busy[slot]:
                raise AssertionError(f"slot {slot} posted while the receiver still holds it")
            self._busy[slot] = True
            self.posted.append((slot, nbytes))
        self._headers.put((bytes(header), slot, nbytes, direct))

    def wait_free(self, slot: int, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy[slot] or self._closed_by is not None, timeout_s)
            if not self._busy[slot]:
                return
            if self._closed_by is not None:
                raise PeerLostError(f"the {self._closed_by} closed the link while slot {slot} was in use")
        raise TransferTimeoutError(f"slot {slot} was not released within {timeout_s:g}s")

    def next_header(self, timeout_s: float) -> tuple[bytes, int, int, tuple[torch.Tensor, ...]]:
        try:
            item = self._headers.get(timeout=timeout_s)
        except queue.Empty:
            raise TransferTimeoutError(f"no bucket header within {timeout_s:g}s") from None
        if item is None:
            raise PeerLostError(f"the {self._closed_by} closed the link")
        return item

    def release(self, slot: int) -> None:
        with self._cond:
            self._busy[slot] = False
            self._cond.notify_all()

    def close(self, side: str) -> None:
        with self._cond:
            if self._closed_by is None:
                self._closed_by = side
            self._cond.notify_all()
        self._headers.put(None)


class InProcessSender(BucketSender):
    """``direct_chunks=True`` lets the pipeline hand over large chunks instead of packing
    them; the receiver then copies each from the sender's tensor into its destination, as if
    it had been sent from where it is."""

    def __init__(self, link: InProcessLink, *, direct_chunks: bool = False) -> None:
        self.link = link
        self.num_slots = len(link.buffers)
        self.direct_chunks = direct_chunks
        self.direct_posts = 0

    def buffer(self, slot: int) -> torch.Tensor:
        return self.link.buffers[slot]

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        if direct and not self.direct_chunks:
            raise AssertionError("the pipeline passed direct chunks to a sender that does not take them")
        for chunk in direct:
            if chunk.dtype != torch.uint8 or chunk.dim() != 1 or not chunk.is_contiguous():
                raise AssertionError(
                    f"a direct chunk must be contiguous 1-D uint8, got {chunk.dtype} {list(chunk.shape)}"
                )
        self.direct_posts += len(direct)
        self.link.post(slot, header, nbytes, tuple(direct))

    def wait_slot(self, slot: int, timeout_s: float) -> None:
        self.link.wait_free(slot, timeout_s)

    def close(self) -> None:
        self.link.close("sender")


class InProcessReceiver(BucketReceiver):
    def __init__(self, link: InProcessLink, *, direct_chunks: bool = False) -> None:
        self.link = link
        self.num_slots = len(link.buffers)
        self.direct_chunks = direct_chunks
        self._announced: tuple[int, int] | None = None  # (slot, nbytes) of the last header
        self._sent_direct: tuple[torch.Tensor, ...] = ()  # the last header's direct chunks
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, destination) pending
        self._buckets = 0

    def buffer(self, slot: int) -> torch.Tensor:
        return self.link.buffers[slot]

    def recv_header(self, timeout_s: float) -> bytes:
        header, slot, nbytes, self._sent_direct = self.link.next_header(timeout_s)
        self._announced = (slot, nbytes)
        return header

    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        # The transport contract: bucket k uses slot k % num_slots on both sides.
        if (slot, nbytes) != self._announced:
            raise AssertionError(f"receiver posted slot {slot} ({nbytes} B), sender sent {self._announced}")
        sizes = [t.numel() for t in direct]
        if sizes != [t.numel() for t in self._sent_direct]:
            raise AssertionError(
                f"receiver posted direct chunks of {sizes} B, sender sent {[t.numel() for t in self._sent_direct]}"
            )
        self._copies = list(zip(self._sent_direct, direct))

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        for source, destination in self._copies:
            destination.copy_(source)
        self._copies = []
        flip = self.link.corrupt.get(self._buckets)
        if flip is not None:
            self.link.buffers[slot][flip] ^= 0xFF
        self._buckets += 1

    def release(self, slot: int) -> None:
        self.link.release(slot)

    def close(self) -> None:
        self.link.close("receiver")


_LINKS: dict[str, InProcessLink] = {}
_LINKS_LOCK = threading.Lock()


class InProcessEngine(BucketedEngine):
    """A ``BucketedEngine`` over :class:`InProcessLink`: one policy and one rollout rank, one process."""

    backend_name: ClassVar[str] = "memory"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu",), topologies=("paired",), placements=("colocated",)
    )

    options = BucketedEngine.options.replace("timeout_s", default=20.0).extend(
        Option.flag("direct_chunks", False, "move chunks of 1 MiB or more as messages of their own, unpacked")
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.direct_chunks: bool = self.option_values.direct_chunks
        self.link: InProcessLink | None = None
        self.sender: InProcessSender | None = None
        self._key = ""

    def _join(self, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]) -> InProcessLink:
        if (train_world_size, rollout_world_size) != (1, 1):
            raise ValueError("InProcessEngine connects exactly one policy rank to one rollout rank")
        self._key = metadata[0]["engine_id"]
        with _LINKS_LOCK:
            self.link = _LINKS.setdefault(self._key, InProcessLink(self.bucket_size))
        return self.link

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender:
        link = self._join(train_world_size, rollout_world_size, metadata)
        self.sender = InProcessSender(link, direct_chunks=self.direct_chunks)
        return self.sender

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        return InProcessReceiver(
            self._join(train_world_size, rollout_world_size, metadata), direct_chunks=self.direct_chunks
        )

    def _release_transport(self) -> None:
        with _LINKS_LOCK:
            _LINKS.pop(self._key, None)


def connected_pair(bucket_size: int, **options: Any) -> tuple[InProcessEngine, InProcessEngine]:
    """A policy engine and a rollout engine, through ``prepare`` and ``init_*`` as the seed says."""
    policy = InProcessEngine(bucket_size=bucket_size, **options)
    rollout = InProcessEngine(bucket_size=bucket_size, **options)
    metadata = [policy.prepare(), rollout.prepare()]
    policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    return policy, rollout


class RefitOutcome:
    """What both sides of one refit did."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, torch.Tensor]]] = []
        self.send_error: BaseException | None = None
        self.receive_error: BaseException | None = None

    @property
    def received(self) -> list[tuple[str, torch.Tensor]]:
        return [item for batch in self.batches for item in batch]


def run_refit(
    policy: InProcessEngine,
    rollout: InProcessEngine,
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    *,
    deadline_s: float = 60.0,
) -> RefitOutcome:
    """One refit: ``policy.send_weights`` on a thread, ``rollout.receive_weight_batches`` here.

    If receiving fails, the rollout engine is finalized (closing its end), so a sender waiting
    on it fails instead of waiting out its timeout. The sender thread must end within
    ``deadline_s``.
    """
    outcome = RefitOutcome()

    def send() -> None:
        try:
            asyncio.run(policy.send_weights(weights()))  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.send_error = exc

    sender = threading.Thread(target=send, name="memory-refit-sender", daemon=True)
    sender.start()

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            outcome.batches.append(batch)

    try:
        asyncio.run(receive())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome.receive_error = exc
        rollout.finalize()
    sender.join(deadline_s)
    if sender.is_alive():
        raise TransferTimeoutError(f"the sender did not finish within {deadline_s}s")
    return outcome
