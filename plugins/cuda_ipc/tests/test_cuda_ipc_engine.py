"""cuda_ipc in one process: options, rendezvous checks, deadlines and aborts.

Policy and rollout engines run in threads of this process over the real transport (Unix
sockets, a memfd passed by SCM_RIGHTS and mapped read-only): fast, and each side still has its
own engine, socket and mapping. Multi-process behaviour is in test_cuda_ipc_processes.py.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import torch

import ckpt_core
from ckpt_core.errors import (
    AuthenticationError,
    BackendUnavailableError,
    EngineOptionError,
    LifecycleError,
    PeerLostError,
    RemoteRefitError,
    TransferTimeoutError,
)
from ckpt_core.registry import list_backends
from ckpt_cuda_ipc import CudaIpcCheckpointEngine
from ckpt_cuda_ipc.control import Kind, Listener, encode_json, sweep_stale

Weights = Generator[tuple[str, torch.Tensor], None, None]

BUCKET = 4096


def make(bucket_size: int = BUCKET, **options: Any) -> CudaIpcCheckpointEngine:
    engine = ckpt_core.create_checkpoint_engine("cuda_ipc", bucket_size_bytes=bucket_size, engine_kwargs=options)
    assert isinstance(engine, CudaIpcCheckpointEngine)
    return engine


class Threads:
    """Run one callable per engine in threads; re-raise nothing, hand back results or errors."""

    def __init__(self, calls: list[Callable[[], Any]]) -> None:
        self.results: list[Any] = [None] * len(calls)
        self.errors: list[BaseException | None] = [None] * len(calls)
        self.threads = [threading.Thread(target=self._run, args=(i, call), daemon=True) for i, call in enumerate(calls)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, call: Callable[[], Any]) -> None:
        try:
            self.results[index] = call()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.errors[index] = exc

    def join(self, timeout_s: float = 30.0) -> Threads:
        for thread in self.threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a worker thread is still blocked: some wait has no deadline"
        return self

    def raise_first(self) -> list[Any]:
        for error in self.errors:
            if error is not None:
                raise error
        return self.results


def connect(policy: CudaIpcCheckpointEngine, rollouts: list[CudaIpcCheckpointEngine]) -> None:
    metadata = [policy.prepare()] + [r.prepare() for r in rollouts]
    n = len(rollouts)
    calls: list[Callable[[], Any]] = [
        lambda: policy.init_policy_process_group(
            worker_rank=0, train_world_size=1, rollout_world_size=n, metadata=metadata
        )
    ]
    for rank, rollout in enumerate(rollouts):
        calls.append(
            functools.partial(
                rollout.init_rollout_process_group,
                rollout_rank=rank,
                train_world_size=1,
                rollout_world_size=n,
                metadata=metadata,
            )
        )
    Threads(calls).join().raise_first()


def receive(engine: CudaIpcCheckpointEngine) -> dict[str, torch.Tensor]:
    async def collect() -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        async for batch in engine.receive_weight_batches():
            out.update(batch)
        return out

    return asyncio.run(collect())


def refit(
    policy: CudaIpcCheckpointEngine,
    rollouts: list[CudaIpcCheckpointEngine],
    weights: Callable[[], Weights],
) -> Threads:
    calls: list[Callable[[], Any]] = [lambda: asyncio.run(policy.send_weights(weights()))]
    calls += [functools.partial(receive, r) for r in rollouts]
    return Threads(calls).join()


def sample_weights(seed: int) -> Weights:
    g = torch.Generator().manual_seed(seed)
    yield "big", torch.randn(3 * BUCKET // 4 + 7, generator=g)  # spans several buckets
    yield "empty", torch.empty(0, 5)
    yield "flag", torch.tensor(seed % 2 == 0)
    yield "half", torch.randn(31, generator=g).to(torch.bfloat16)


def assert_same(received: dict[str, torch.Tensor], seed: int) -> None:
    expected = dict(sample_weights(seed))
    assert list(received) == list(expected)
    for name, tensor in expected.items():
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(
            got.view(torch.uint8) if got.numel() else got, tensor.view(torch.uint8) if tensor.numel() else tensor
        ), name


@pytest.fixture
def sockets() -> Iterator[str]:
    """A socket directory with a short path (pytest's own, under xdist, can exceed what a Unix
    socket's path may hold)."""
    path = tempfile.mkdtemp(prefix="ckpt-ipc-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- options and capabilities -----------------------------------------------------------


def test_declares_cpu_and_cuda_and_runs_here() -> None:
    assert CudaIpcCheckpointEngine.unavailable_reason() is None
    assert CudaIpcCheckpointEngine.capabilities.devices == ("cpu", "cuda")
    assert CudaIpcCheckpointEngine.capabilities.topologies == ("broadcast", "fanout")
    (info,) = [b for b in list_backends(details=True) if b.name == "cuda_ipc"]
    assert info.loads and info.unavailable_reason is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_device_without_cuda_fails_at_construction(device: str) -> None:
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device.*device='cpu'"):
        make(device=device)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"device": "mps"}, "device must be"),
        ({"device": "cpu:1"}, "device must be"),
        ({"device": 0}, "device must be"),
        ({"device": "gpu"}, "device must be"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"checksum": "yes"}, "checksum"),
        ({"socket_dir": "/nonexistent/dir"}, "socket_dir"),
        ({"socket_dir": "/tmp/" + "x" * 120}, "socket_dir"),
        ({"socket_dir": 5}, "socket_dir"),
        ({"topology": "paired"}, "topology must be one of 'broadcast', 'fanout'"),
        ({"topology": "fanout", "device": "cuda"}, "topology='fanout' is host-only for now"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], match: str) -> None:
    with pytest.raises(EngineOptionError, match=match):
        make(**options)


def test_checksum_defaults_off_and_is_the_host_one_when_on() -> None:
    from ckpt_core._internal.checksum import payload_checksum

    assert make()._payload_checksum() is None
    assert make(checksum=True)._payload_checksum() is payload_checksum


# --- rendezvous ----------------------------------------------------------------------------


def test_refits_in_threads_and_cleans_up(sockets: str) -> None:
    policy, rollouts = make(socket_dir=sockets), [make(socket_dir=sockets) for _ in range(2)]
    connect(policy, rollouts)
    assert os.listdir(sockets) == []  # every listener is gone once all are connected
    for seed in range(3):
        results = refit(policy, rollouts, functools.partial(sample_weights, seed)).raise_first()
        for received in results[1:]:
            assert_same(received, seed)
    assert policy.last_stats is not None and policy.last_stats.buckets > 3
    for engine in [policy, *rollouts]:
        engine.finalize()
    # prepare() works again after finalize().
    connect(policy, rollouts[:1])
    assert_same(refit(policy, rollouts[:1], lambda: sample_weights(9)).raise_first()[1], 9)
    policy.finalize()
    rollouts[0].finalize()
    assert os.listdir(sockets) == []


def test_mismatched_bucket_size_is_refused_before_connecting(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets), make(bucket_size=2 * BUCKET, socket_dir=sockets)
    metadata = [policy.prepare(), rollout.prepare()]
    with pytest.raises(EngineOptionError, match="bucket_size"):
        rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    policy.finalize()
    rollout.finalize()


def test_rollout_on_another_node_is_refused(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets), make(socket_dir=sockets)
    metadata = [policy.prepare(), rollout.prepare()]
    metadata[0]["node"] = "elsewhere/boot"
    with pytest.raises(BackendUnavailableError, match="one node"):
        rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    policy.finalize()
    rollout.finalize()


def test_stranger_is_rejected_and_real_rollout_still_joins(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets, timeout_s=10), make(socket_dir=sockets, timeout_s=10)
    metadata = [policy.prepare(), rollout.prepare()]
    init = Threads(
        [
            lambda: policy.init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
            )
        ]
    )
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.settimeout(10)
    stranger.connect(metadata[0]["socket"])
    body = encode_json(
        {"type": "hello", "rollout_rank": 0, "engine_id": "forged", "policy_engine_id": metadata[0]["engine_id"]}
    )
    stranger.sendall(bytes([Kind.CONTROL]) + len(body).to_bytes(4, "big") + body)
    reply = stranger.recv(4096)
    stranger.close()
    assert b"reject" in reply and b"engine id" in reply
    rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    init.join().raise_first()
    assert_same(refit(policy, [rollout], lambda: sample_weights(1)).raise_first()[1], 1)
    policy.finalize()
    rollout.finalize()


def test_rejected_rollout_gets_a_clear_error(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets, timeout_s=2), make(socket_dir=sockets, timeout_s=2)
    metadata = [policy.prepare(), rollout.prepare()]
    forged = [dict(m) for m in metadata]
    forged[0]["engine_id"] = "another-engine"
    init = Threads(
        [
            lambda: policy.init_policy_process_group(
                worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata
            )
        ]
    )
    with pytest.raises(AuthenticationError, match="not a rollout of this engine"):
        rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=forged)
    init.join()
    assert isinstance(init.errors[0], TransferTimeoutError)
    assert "rollout ranks [0]" in str(init.errors[0])
    policy.finalize()
    rollout.finalize()


def test_failed_init_must_start_over(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets, timeout_s=0.3), make(socket_dir=sockets)
    metadata = [policy.prepare(), rollout.prepare()]
    init: dict[str, Any] = dict(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    with pytest.raises(TransferTimeoutError, match=r"rollout ranks \[0\] to connect"):
        policy.init_policy_process_group(**init)
    with pytest.raises(LifecycleError, match="finalize"):
        policy.init_policy_process_group(**init)
    policy.finalize()
    rollout.finalize()
    assert os.listdir(sockets) == []


def test_rollout_of_a_finalized_policy_fails_at_once(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets), make(socket_dir=sockets)
    metadata = [policy.prepare(), rollout.prepare()]
    policy.finalize()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="policy rank 0"):
        rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    assert time.monotonic() - start < 5
    rollout.finalize()


# --- deadlines and failures during a refit ----------------------------------------------


def test_waiting_for_a_refit_that_never_comes_times_out(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets, timeout_s=0.5), make(socket_dir=sockets, timeout_s=0.5)
    connect(policy, [rollout])
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="policy rank 0.*timeout_s=0.5"):
        receive(rollout)
    assert time.monotonic() - start < 5
    with pytest.raises(LifecycleError):  # a failed refit voids the engine until it is re-initialized
        receive(rollout)
    policy.finalize()
    rollout.finalize()


def test_policy_waits_at_most_timeout_for_a_stuck_rollout(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets, timeout_s=0.5), make(socket_dir=sockets, timeout_s=30)
    connect(policy, [rollout])
    start = time.monotonic()
    # Nobody receives: the policy fills both slots, then must wait for a release that never comes.
    with pytest.raises(TransferTimeoutError, match="rollout rank 0.*release slot"):
        asyncio.run(policy.send_weights(sample_weights(0)))
    assert time.monotonic() - start < 5
    # The rollout, which never started receiving, is told the refit failed instead of waiting 30 s.
    with pytest.raises(RemoteRefitError, match="abandoned the refit"):
        receive(rollout)
    policy.finalize()
    rollout.finalize()


def test_failing_weights_abort_every_rollout_promptly(sockets: str) -> None:
    policy, rollouts = (
        make(socket_dir=sockets, timeout_s=20),
        [make(socket_dir=sockets, timeout_s=20) for _ in range(2)],
    )
    connect(policy, rollouts)

    def failing() -> Weights:
        yield from sample_weights(0)
        raise ValueError("the trainer broke")

    start = time.monotonic()
    threads = refit(policy, rollouts, failing)
    assert time.monotonic() - start < 10  # no one waits out timeout_s=20
    assert isinstance(threads.errors[0], ValueError)
    for error in threads.errors[1:]:
        assert isinstance(error, RemoteRefitError) and "the trainer broke" in str(error)
    for engine in [policy, *rollouts]:
        engine.finalize()


def test_rollout_sees_a_clean_policy_shutdown(sockets: str) -> None:
    policy, rollout = make(socket_dir=sockets, timeout_s=10), make(socket_dir=sockets, timeout_s=10)
    connect(policy, [rollout])
    policy.finalize()
    with pytest.raises(PeerLostError, match="finalized its engine"):
        receive(rollout)
    rollout.finalize()


# --- leftovers ----------------------------------------------------------------------------


def test_stale_directory_of_a_killed_process_is_swept(sockets: str) -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: listen, say where, then wait to be killed (it never cleans up)
        os.close(read_end)
        listener = Listener(sockets)
        os.write(write_end, listener.directory.encode())
        time.sleep(60)
        os._exit(0)
    os.close(write_end)
    try:
        stale = os.read(read_end, 4096).decode()
    finally:
        os.close(read_end)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    live = Listener(sockets)
    try:
        assert os.path.isdir(stale)
        assert sweep_stale(sockets) == [stale]
        assert os.listdir(sockets) == [os.path.basename(live.directory)]
    finally:
        live.close()


def test_refits_with_descriptors_past_select_s_limit(sockets: str) -> None:
    """A process may hold more than 1024 descriptors (``select``'s limit): the control channels
    opened after them still carry every refit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"this process may open at most {hard} descriptors (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    spare = os.open(os.devnull, os.O_RDONLY)
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:  # each dup takes the lowest free number
            held.append(os.dup(spare))
        policy, rollout = make(socket_dir=sockets), make(socket_dir=sockets)
        connect(policy, [rollout])
        try:
            for seed in range(2):
                assert_same(refit(policy, [rollout], functools.partial(sample_weights, seed)).raise_first()[1], seed)
        finally:
            policy.finalize()
            rollout.finalize()
    finally:
        for fd in [spare, *held]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
