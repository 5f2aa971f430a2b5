"""A Gloo pair moves a bucket's header and packed payload as one message, received straight
into the slot the receiver has free (ckpt_core.transport.torch_distributed's docstring): real
processes, a real Gloo pair, the transport's calls made by hand (tests/helpers/gloo_pair.py)."""

from __future__ import annotations

import datetime
import multiprocessing
from typing import Any

import torch.distributed as dist

from tests.helpers import gloo_pair


def _exchange(broadcast: bool) -> dict[str, Any]:
    # The pair's store lives here, on a port it binds itself: a port probed free and bound
    # later by a worker can be taken in between by another test process.
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    port = store.port
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=gloo_pair.run, args=(rank, port, broadcast, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        seen: dict[str, Any] = results.get(timeout=60)
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    assert "error" not in seen, seen["error"]
    return seen


def test_a_pairs_payload_arrives_with_its_header_and_never_into_a_held_slot() -> None:
    seen = _exchange(broadcast=False)
    assert seen["ready_with_header"] is True
    assert (seen["h0"], seen["slot0_at_h0"]) == (b"h0", [1])  # readable before post_payload
    assert (seen["h1"], seen["slot1_at_h1"]) == (b"h1", [2])
    # Bucket 2 is due in slot 0 while the pipeline still reads it: nothing is received there.
    assert "has not released" in seen["held_slot"]
    assert seen["slot0_held"] == [1]
    assert (seen["h2"], seen["slot0_at_end"]) == (b"h2", [3])


def test_a_broadcast_posts_its_payload_after_the_header() -> None:
    """Every member of a Gloo broadcast posts the same size, so the frame travels alone."""
    seen = _exchange(broadcast=True)
    assert seen["ready_with_header"] is False
    assert (seen["h0"], seen["slot0_at_h0"]) == (b"h0", [0])  # not there before post_payload
    assert (seen["h2"], seen["slot0_at_end"]) == (b"h2", [3])
