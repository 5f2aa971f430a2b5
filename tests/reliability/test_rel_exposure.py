"""Strangers who can reach a worker's ports or sockets cannot crash it or hold it up.

Threat model (docs/reliability.md, "Who may reach what"): any process that can reach the
policy's or a rollout's address may connect to its TCP ports; any process of the same user
on the node may connect to a cuda_ipc control socket. Here such strangers, on loopback only:

* connect over and over to every TCP port an initialized gloo_cpu worker listens on, in a
  child process whose descriptor limit is lowered so a leak of one descriptor per connection
  would abort it (Gloo's accept throws when descriptors run out). The worker must survive, its
  descriptor count must stay put, and the next refit must be bit-exact;
* try to write into the rendezvous store after init: it must be closed;
* connect to a cuda_ipc policy's control socket while it waits for its rollouts, silently or
  sending a malformed frame, or many at once: the rollouts must still join.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import selectors
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckpt_core.base import CheckpointEngine, create_checkpoint_engine
from ckpt_cuda_ipc.control import Kind, encode_json
from tests.reliability.rel_inprocess import collect, concurrently
from tests.reliability.rel_team import HERE, worker_env

NOFILE = 256
"""The child's descriptor limit: it holds about 40 after init, so ~220 leaked connections kill it."""
CONNECTIONS = 1000
"""Connections tried per port, all at once: enough to exhaust NOFILE four times over."""
CONNECT_TIMEOUT_S = 2.0
CHILD_DEADLINE_S = 120.0


def _connect_many(host: str, port: int, attempts: int) -> tuple[int, str]:
    """Start ``attempts`` connections at once and wait up to ``CONNECT_TIMEOUT_S`` for them;
    returns how many were established (then closes them all) and how the others ended."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    pending = []
    try:
        for _ in range(attempts):
            sock = socket.socket(family, socket.SOCK_STREAM)
            pending.append(sock)
            sock.setblocking(False)
            sock.connect_ex((host, port))
        established = 0
        outcomes: dict[str, int] = {}
        with selectors.DefaultSelector() as selector:
            for sock in pending:
                selector.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while selector.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    selector.unregister(key.fileobj)
                    error = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # type: ignore[union-attr]
                    if error == 0:
                        established += 1
                    else:
                        outcomes[os.strerror(error)] = outcomes.get(os.strerror(error), 0) + 1
            if selector.get_map():
                outcomes[f"no answer within {CONNECT_TIMEOUT_S:g}s"] = len(selector.get_map())
        return established, ", ".join(f"{count} {what}" for what, count in outcomes.items()) or "all established"
    finally:
        for sock in pending:
            sock.close()


@pytest.mark.slow
def test_strangers_connecting_to_every_port_cannot_exhaust_descriptors() -> None:
    child = subprocess.Popen(
        [sys.executable, str(HERE / "rel_exposed_child.py"), str(NOFILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        ready = json.loads(child.stdout.readline() or "null")
        assert ready, (
            f"the child did not initialize: {child.wait(CHILD_DEADLINE_S)} "
            f"{child.stderr.read() if child.stderr else ''}"
        )
        host, store_port = ready["store"]
        accepted = {}
        for address in ready["listening"]:
            where, port = address.rsplit(":", 1)
            accepted[address] = _connect_many(where, int(port), CONNECTIONS)
        try:
            child.stdin.write("refit\n")
            child.stdin.flush()
        except BrokenPipeError:  # it died meanwhile: its exit status says how
            pass
        done = json.loads(child.stdout.readline() or "null")
        status = child.wait(CHILD_DEADLINE_S)
        stderr = child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert status == 0 and done and done["refit"] == "ok", (
        f"the worker died (exit status {status}) after strangers connected {accepted}; stderr: {stderr[-2000:]}"
    )
    assert done["fds"] <= ready["fds"] + 2, f"descriptors grew from {ready['fds']} to {done['fds']}: {accepted}"
    assert all(count == 0 for count, _ in accepted.values()), f"listeners still accept strangers: {accepted}"
    assert f"{host}:{store_port}" not in ready["listening"], "the rendezvous store still listens after init"


def _refit_once(policy: CheckpointEngine, rollout: CheckpointEngine) -> None:
    """One refit between two initialized engines, checked bit-exact."""
    weights = [("w", torch.arange(5000, dtype=torch.float32))]
    sent, received = concurrently(
        lambda: asyncio.run(policy.send_weights(iter(weights))),  # type: ignore[arg-type]
        lambda: asyncio.run(collect(rollout)),
    )
    sent.get()
    assert [t.tolist() for _, t in received.get()] == [weights[0][1].tolist()]


def test_the_rendezvous_store_is_closed_after_init() -> None:
    """An unauthenticated client could write keys into policy rank 0's store for the engine's
    whole life; once the groups have formed it must be gone. (The nccl engine's own test is in
    plugins/nccl/tests/test_nccl_host_conformance.py: its ranks need processes of their own.)"""
    policy, rollout = (
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=4096, engine_kwargs={"timeout_s": 20}) for _ in range(2)
    )
    try:
        metadata = [policy.prepare(), rollout.prepare()]
        sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
        for outcome in concurrently(
            lambda: policy.init_policy_process_group(worker_rank=0, **sizes),
            lambda: rollout.init_rollout_process_group(rollout_rank=0, **sizes),
        ):
            outcome.get()
        host, port = metadata[0]["host"], metadata[0]["port"]
        with pytest.raises((RuntimeError, OSError)):
            stranger = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=1))
            stranger.set("stranger/" + "k" * 64, "x" * (1 << 20))  # reached only if it connected
        _refit_once(policy, rollout)
    finally:
        policy.finalize()
        rollout.finalize()


# --- cuda_ipc: strangers at the control socket during init ------------------------------------


def _frame(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + len(body).to_bytes(4, "big") + body


def _init_with_strangers(strangers: list[bytes | None], timeout_s: float = 10.0) -> None:
    """Prepare a cuda_ipc pair, connect one stranger per entry (sending those bytes, or
    nothing for ``None``) before the rollout connects, then init both and refit once."""
    policy, rollout = (
        create_checkpoint_engine(
            "cuda_ipc", bucket_size_bytes=4096, engine_kwargs={"device": "cpu", "timeout_s": timeout_s}
        )
        for _ in range(2)
    )
    sockets = []
    try:
        metadata = [policy.prepare(), rollout.prepare()]
        for data in strangers:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(metadata[0]["socket"])
            if data:
                sock.sendall(data)
            sockets.append(sock)
        sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
        policy_init, rollout_init = concurrently(
            lambda: policy.init_policy_process_group(worker_rank=0, **sizes),
            lambda: rollout.init_rollout_process_group(rollout_rank=0, **sizes),
        )
        policy_init.get()
        rollout_init.get()
        _refit_once(policy, rollout)
    finally:
        for sock in sockets:
            sock.close()
        policy.finalize()
        rollout.finalize()


def test_a_malformed_frame_at_the_control_socket_does_not_fail_the_init() -> None:
    _init_with_strangers([_frame(9, b"what"), _frame(Kind.CONTROL, b"\xff not json"), b"\x01\xff\xff\xff\xff"])


def test_a_silent_connection_does_not_hold_up_the_handshake() -> None:
    """Nor does one that stops mid-frame. With timeout_s=10, a policy that waited for either's
    hello would time out."""
    _init_with_strangers([None, _frame(Kind.CONTROL, encode_json({"type": "hello"}))[:-3]])


def test_many_strangers_at_once_are_bounded_and_closed() -> None:
    """More strangers than the lobby holds: the oldest are dropped, the rollout still joins."""
    _init_with_strangers([None] * 100)
