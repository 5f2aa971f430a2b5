"""A child process holding an initialized gloo_cpu pair, for strangers to connect to.

Run as ``python rel_exposed_child.py NOFILE``: lowers ``RLIMIT_NOFILE`` to ``NOFILE``, builds
policy rank 0 and rollout rank 0 (on threads, real Gloo groups and sockets), then prints one
JSON line: the rendezvous store's address, every TCP port it listens on and its descriptor
count. On a
line ``refit`` from stdin it runs one refit, prints ``{"refit": "ok", ...}`` with its
descriptor count, and exits 0. Anything that kills it (Gloo aborting when descriptors run
out) shows as its exit status.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import resource
import sys
from typing import Any

import torch

from ckpt_core.base import create_checkpoint_engine
from tests.reliability.rel_inprocess import collect, concurrently
from tests.reliability.rel_net import descriptor_count, listening_sockets


def _send(policy: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    asyncio.run(policy.send_weights(item for item in weights))


def main() -> None:
    nofile = int(sys.argv[1])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    policy, rollout = (
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1 << 16, engine_kwargs={"timeout_s": 30})
        for _ in range(2)
    )
    metadata = [policy.prepare(), rollout.prepare()]
    sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
    for outcome in concurrently(
        lambda: policy.init_policy_process_group(worker_rank=0, **sizes),
        lambda: rollout.init_rollout_process_group(rollout_rank=0, **sizes),
    ):
        outcome.get()
    print(
        json.dumps(
            {
                "store": [metadata[0]["host"], metadata[0]["port"]],
                "listening": listening_sockets(os.getpid()),
                "fds": descriptor_count(os.getpid()),
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        if line.strip() == "refit":
            weights = [("w", torch.arange(50_000, dtype=torch.float32)), ("b", torch.ones(7))]
            sent, received = concurrently(
                functools.partial(_send, policy, weights),
                lambda: asyncio.run(collect(rollout)),
            )
            sent.get()
            got = received.get()
            assert [(n, t.tolist()) for n, t in got] == [(n, t.tolist()) for n, t in weights]
            print(json.dumps({"refit": "ok", "fds": descriptor_count(os.getpid())}), flush=True)
            break
    policy.finalize()
    rollout.finalize()


if __name__ == "__main__":
    main()
