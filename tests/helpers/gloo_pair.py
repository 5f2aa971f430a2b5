"""One side of a Gloo pair driven through ``DistributedSender`` / ``DistributedReceiver`` by
hand, bucket by bucket, for tests/transport/test_framed_buckets.py (run in a process of its own)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from ckpt_core.errors import LifecycleError
from ckpt_core.transport.torch_distributed import DistributedReceiver, DistributedSender, Link, gloo_group

BUCKET = 4096
NBYTES = 100
TIMEOUT_S = 30.0


def run(rank: int, port: int, broadcast: bool, results: Any) -> None:
    """Both ranks join the test's store on ``port``. Rank 0 sends three buckets (slots 0, 1,
    then 0 again, filled with 1s, 2s and 3s); rank 1 receives them and puts what it saw, step
    by step, on ``results``."""
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=TIMEOUT_S))
        group = gloo_group(store, rank, 2, host="127.0.0.1", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        link = Link(group, group, rank=rank, size=2, broadcast=broadcast, peer=f"rank {1 - rank}")
        if rank == 0:
            _send(DistributedSender(link, BUCKET, torch.device("cpu")))
        else:
            results.put(_receive(DistributedReceiver(link, BUCKET, torch.device("cpu"))))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})


def _send(sender: DistributedSender) -> None:
    for index, slot in enumerate((0, 1, 0)):
        sender.wait_slot(slot, TIMEOUT_S)
        sender.buffer(slot)[:NBYTES] = index + 1
        sender.post(slot, f"h{index}".encode(), NBYTES, TIMEOUT_S)
    for slot in (0, 1):
        sender.wait_slot(slot, TIMEOUT_S)


def _filled(receiver: DistributedReceiver, slot: int) -> list[int]:
    """The distinct byte values of the first ``NBYTES`` of ``slot``."""
    return sorted(set(receiver.buffer(slot)[:NBYTES].tolist()))


def _receive(receiver: DistributedReceiver) -> dict[str, Any]:
    seen: dict[str, Any] = {"ready_with_header": receiver.payload_ready_with_header}
    seen["h0"] = receiver.recv_header(TIMEOUT_S)
    seen["slot0_at_h0"] = _filled(receiver, 0)  # before post_payload
    receiver.post_payload(0, NBYTES, TIMEOUT_S)
    receiver.expect_header()
    receiver.wait_payload(0, TIMEOUT_S)
    seen["h1"] = receiver.recv_header(TIMEOUT_S)
    seen["slot1_at_h1"] = _filled(receiver, 1)
    receiver.post_payload(1, NBYTES, TIMEOUT_S)
    receiver.expect_header()  # bucket 2 is due in slot 0, which is not released yet
    receiver.wait_payload(1, TIMEOUT_S)
    if receiver.payload_ready_with_header:
        try:
            receiver.recv_header(TIMEOUT_S)
            seen["held_slot"] = "received"
        except LifecycleError as exc:
            seen["held_slot"] = str(exc)
        time.sleep(0.3)  # the sender has posted bucket 2 by now
        seen["slot0_held"] = _filled(receiver, 0)
    receiver.release(0)
    receiver.release(1)
    seen["h2"] = receiver.recv_header(TIMEOUT_S)
    receiver.post_payload(0, NBYTES, TIMEOUT_S)
    receiver.wait_payload(0, TIMEOUT_S)
    seen["slot0_at_end"] = _filled(receiver, 0)
    return seen
