"""Bad inputs and the errors they must get: one :class:`Case` per row of the table in
``docs/reliability.md``.

Each case runs in this process against real engines (a lone engine for option, lifecycle and
metadata checks; a policy/rollout :class:`~rel_inprocess.Pair` on threads where a peer is
needed) and raises the error a user would see. ``test_rel_bad_inputs.py`` checks each one;
``python -m tests.reliability.rel_bad_inputs`` prints the table for the docs from what the
code raises today.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import uuid
import warnings
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ckpt_core._internal.wire import FORMAT_VERSION, BucketHeader, decode_header, encode_header
from ckpt_core.base import CheckpointEngine, TensorMeta, create_checkpoint_engine, merge_weight_chunk_batches
from ckpt_core.errors import (
    AuthenticationError,
    BackendImportError,
    BackendUnavailableError,
    CheckpointEngineError,
    ChunkStreamError,
    EngineOptionError,
    LifecycleError,
    NotAnEngineError,
    RemoteRefitError,
    UnknownBackendError,
    UnsupportedTensorError,
    WireFormatError,
)
from ckpt_core.orchestration.coordinator import RefitCoordinator
from tests.helpers.headers import header_bytes_of, header_fields
from tests.reliability.rel_inprocess import Pair, collect, concurrently

BUCKET = 4096


@dataclasses.dataclass(frozen=True)
class Case:
    """One kind of bad input. ``run(tmp_path)`` must raise an instance of every type in
    ``expect`` whose message matches ``match`` (a regular expression)."""

    id: str
    what: str
    run: Callable[[Path], Any]
    expect: tuple[type[BaseException], ...]
    match: str
    needs: str | None = None
    """Why the case cannot run here, if it cannot (checked at run time)."""


# --- building blocks ------------------------------------------------------------------------


def engine(backend: str = "gloo_cpu", bucket_size: Any = BUCKET, **options: Any) -> CheckpointEngine:
    return create_checkpoint_engine(backend, bucket_size_bytes=bucket_size, engine_kwargs={"timeout_s": 20, **options})


@contextmanager
def prepared(backend: str = "gloo_cpu", **options: Any) -> Iterator[tuple[CheckpointEngine, dict[str, Any]]]:
    """A prepared engine and its metadata entry; finalized afterwards."""
    e = engine(backend, **options)
    try:
        yield e, e.prepare()
    finally:
        e.finalize()


def other(entry: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A metadata entry as another worker of the same backend would have produced it."""
    return {**entry, "engine_id": uuid.uuid4().hex, **changes}


def init_policy(e: CheckpointEngine, metadata: Any, rank: Any = 0, train: Any = 1, rollout: Any = 1) -> None:
    e.init_policy_process_group(worker_rank=rank, train_world_size=train, rollout_world_size=rollout, metadata=metadata)


def init_rollout(e: CheckpointEngine, metadata: Any, rank: Any = 0, train: Any = 1, rollout: Any = 1) -> None:
    e.init_rollout_process_group(
        rollout_rank=rank, train_world_size=train, rollout_world_size=rollout, metadata=metadata
    )


def _init_as_rank(rank: Any) -> Callable[[CheckpointEngine, dict[str, Any]], Any]:
    """Init as policy ``rank`` of 2 (a case per bad rank)."""
    return lambda e, m: init_policy(e, [m, other(m), other(m)], rank=rank, train=2)


def _init_with_train_size(train: Any) -> Callable[[CheckpointEngine, dict[str, Any]], Any]:
    """Init with ``train_world_size=train`` (a case per bad size)."""
    return lambda e, m: init_policy(e, [m, other(m)], train=train)


def with_prepared(
    action: Callable[[CheckpointEngine, dict[str, Any]], Any], backend: str = "gloo_cpu", **options: Any
) -> Callable[[Path], Any]:
    def run(_: Path) -> Any:
        with prepared(backend, **options) as (e, entry):
            return action(e, entry)

    return run


def build(backend: Any, bucket_size: Any = BUCKET, **options: Any) -> Callable[[Path], Any]:
    return lambda _: engine(backend, bucket_size, **options)


def send(e: CheckpointEngine, weights: list[tuple[Any, Any]]) -> None:
    asyncio.run(e.send_weights(iter(weights)))  # type: ignore[arg-type]


def receive(e: CheckpointEngine) -> Any:
    return asyncio.run(collect(e))


def tensor(n: int = 1000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def bad_weights(weights: Callable[[], list[tuple[Any, Any]]]) -> Callable[[Path], Any]:
    """A refit on a live pair whose policy yields ``weights()``: the policy's error is the
    case's; the rollout must fail at once with RemoteRefitError carrying that message."""

    def run(_: Path) -> Any:
        pair = Pair()
        try:
            sent, received = pair.refit(weights)
            assert sent.error is not None, "the policy accepted the bad weights"
            assert isinstance(received.error, RemoteRefitError), f"rollout got {received.error!r}, not RemoteRefitError"
            assert str(sent.error) in str(received.error), "the rollout's error must carry the policy's message"
            raise sent.error
        finally:
            pair.finalize()

    return run


def on_pair(action: Callable[[Pair], Any], **pair_options: Any) -> Callable[[Path], Any]:
    def run(_: Path) -> Any:
        pair = Pair(**pair_options)
        try:
            for outcome in pair.init_outcomes:
                outcome.get()
            return action(pair)
        finally:
            pair.finalize()

    return run


def two_sends_at_once(pair: Pair) -> None:
    weights = [(f"w{i}", tensor(2000)) for i in range(8)]
    result: dict[str, Any] = {}

    async def both() -> None:
        result["outcomes"] = await asyncio.gather(
            pair.policy.send_weights(w for w in weights),
            pair.policy.send_weights(w for w in weights),
            return_exceptions=True,
        )

    sent, received = concurrently(lambda: asyncio.run(both()), lambda: receive(pair.rollout))
    sent.get()
    first, second = result["outcomes"]
    assert first is None, f"the first send must go through, got {first!r}"
    assert [name for name, _ in received.get()] == [name for name, _ in weights], "the first refit must arrive whole"
    raise second


def refit_then(after: Callable[[Pair], Any]) -> Callable[[Pair], Any]:
    def action(pair: Pair) -> Any:
        sent, received = pair.refit(lambda: [("w", tensor())])
        sent.get()
        received.get()
        return after(pair)

    return action


def failed_refit_then_send(pair: Pair) -> None:
    sent, received = pair.refit(lambda: [("w", tensor()), ("w", tensor())])
    assert isinstance(sent.error, UnsupportedTensorError) and isinstance(received.error, RemoteRefitError)
    send(pair.policy, [("w", tensor())])


def finalize_then_send(pair: Pair) -> None:
    pair.policy.finalize()
    send(pair.policy, [("w", tensor())])


def auth(policy_token: str | None, rollout_token: str | None, *, rollout_env: bool = False) -> Callable[[Path], Any]:
    """Rendezvous of two engines holding these tokens (the rollout's from CKPT_CORE_AUTH_TOKEN
    when ``rollout_env``). Both sides must be refused; the policy's error is the case's."""

    def run(_: Path) -> Any:
        policy = engine(**({"auth_token": policy_token} if policy_token else {}))
        if rollout_env:
            assert rollout_token is not None
            previous = os.environ.get("CKPT_CORE_AUTH_TOKEN")
            os.environ["CKPT_CORE_AUTH_TOKEN"] = rollout_token
            try:
                rollout = engine()
            finally:
                if previous is None:
                    del os.environ["CKPT_CORE_AUTH_TOKEN"]
                else:
                    os.environ["CKPT_CORE_AUTH_TOKEN"] = previous
        else:
            rollout = engine(**({"auth_token": rollout_token} if rollout_token else {}))
        pair = Pair.of(policy, rollout)
        try:
            policy_outcome, rollout_outcome = pair.init_outcomes
            assert isinstance(rollout_outcome.error, AuthenticationError), f"the rollout got {rollout_outcome.error!r}"
            raise policy_outcome.error or AssertionError("the policy accepted the peer")
        finally:
            pair.finalize()

    return run


def header_bytes(**changes: Any) -> bytes:
    meta = TensorMeta("w", torch.Size([4]), torch.float32, 0, 16, 0)
    doc = header_fields(encode_header(BucketHeader(0, 0, 16, True, (meta,), 1234)))
    doc.update(changes)
    return header_bytes_of(doc)


def decode(raw: bytes) -> Callable[[Path], Any]:
    return lambda _: decode_header(raw, bucket_size=BUCKET)


def meta_dict(**changes: Any) -> Callable[[Path], Any]:
    data = {**TensorMeta("w", torch.Size([4]), torch.float32, 0, 16, 0).to_dict(), **changes}
    return lambda _: TensorMeta.from_dict(json.loads(json.dumps(data)))


def merge_with_gap(_: Path) -> None:
    meta = TensorMeta("w", torch.Size([8]), torch.float32, 0, 16, 0)
    later = TensorMeta("w", torch.Size([8]), torch.float32, 20, 12, 0)

    async def batches() -> AsyncGenerator[list[tuple[TensorMeta, torch.Tensor]], None]:
        yield [(meta, torch.zeros(16, dtype=torch.uint8)), (later, torch.zeros(12, dtype=torch.uint8))]

    async def drain() -> None:
        async for _ in merge_weight_chunk_batches(batches()):
            pass

    asyncio.run(drain())


class _NoCallsPool:
    """A pool for coordinator argument checks that happen before any worker is reached."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def call(self, calls: Any, timeout_s: float) -> Any:
        raise AssertionError("the coordinator reached a worker before checking its own state")


def without_cuda() -> str | None:
    return "a machine without CUDA" if torch.cuda.is_available() else None


# --- the table ------------------------------------------------------------------------------

OURS_AND_VALUE = (CheckpointEngineError, ValueError)
"""Expected of argument errors that today raise a bare ValueError: one of our types (the
caller can catch ``CheckpointEngineError``) that still is a ``ValueError``."""

CASES: list[Case] = [
    # choosing a backend
    Case(
        "unknown-backend",
        'backend name nobody registered (`"no_such_backend"`)',
        build("no_such_backend"),
        (UnknownBackendError,),
        r"Unknown checkpoint-engine backend 'no_such_backend'.*Installed backends",
    ),
    Case(
        "misspelled-backend",
        'misspelled backend name (`"gloo_cpo"`)',
        build("gloo_cpo"),
        (UnknownBackendError,),
        r"Did you mean 'gloo_cpu'",
    ),
    Case(
        "backend-not-str",
        "backend that is not a string (`None`)",
        build(None),
        (UnknownBackendError,),
        r"backend must be a non-empty string",
    ),
    Case(
        "target-not-engine",
        "`module:Class` that is not an engine (`collections:OrderedDict`)",
        build("collections:OrderedDict"),
        (NotAnEngineError,),
        r"not a subclass of ckpt_core.CheckpointEngine",
    ),
    Case(
        "target-abstract",
        "`module:Class` that is abstract (`ckpt_core.base:CheckpointEngine`)",
        build("ckpt_core.base:CheckpointEngine"),
        (NotAnEngineError,),
        r"is abstract; it lacks",
    ),
    Case(
        "target-missing-class",
        "`module:Class` naming a missing class",
        build("ckpt_gloo_cpu.engine:NoSuchEngine"),
        (NotAnEngineError,),
        r"has no attribute 'NoSuchEngine'",
    ),
    Case(
        "target-missing-module",
        "`module:Class` whose module does not import",
        build("no_such_module_for_ckpt:Engine"),
        (BackendImportError,),
        r"importing 'no_such_module_for_ckpt' failed",
    ),
    # engine options
    Case(
        "option-typo",
        "unknown engine option (`topolgy=`)",
        build("gloo_cpu", topolgy="paired"),
        (EngineOptionError,),
        r"no option 'topolgy'.*did you mean 'topology'",
    ),
    Case(
        "options-not-dict",
        "`engine_kwargs` that is not a dict",
        lambda _: create_checkpoint_engine("gloo_cpu", bucket_size_bytes=BUCKET, engine_kwargs=[("timeout_s", 1)]),  # type: ignore[arg-type]
        (EngineOptionError,),
        r"engine_kwargs must be a dict",
    ),
    Case(
        "bucket-size-as-option",
        "`bucket_size` inside `engine_kwargs`",
        lambda _: create_checkpoint_engine("gloo_cpu", bucket_size_bytes=BUCKET, engine_kwargs={"bucket_size": BUCKET}),
        (EngineOptionError,),
        r"bucket_size_bytes",
    ),
    *[
        Case(
            f"bucket-size-{label}",
            f"`bucket_size_bytes={value!r}`",
            build("gloo_cpu", value),
            (CheckpointEngineError,),
            r"bucket_size.*(positive|>= ?1)",
        )
        for label, value in (("0", 0), ("negative", -1), ("float", 1.5), ("bool", True), ("str", "64MiB"))
    ],
    Case(
        "timeout-str",
        '`timeout_s` of the wrong type (`"10"`)',
        build("gloo_cpu", timeout_s="10"),
        (EngineOptionError,),
        r"timeout_s must be a finite number > 0",
    ),
    *[
        Case(
            f"timeout-{label}",
            f"non-positive or non-finite `timeout_s={value!r}`",
            build("gloo_cpu", timeout_s=value),
            (EngineOptionError,),
            r"timeout_s must be a finite number > 0",
        )
        for label, value in (("0", 0), ("negative", -1), ("nan", float("nan")), ("inf", float("inf")))
    ],
    Case(
        "topology-unknown",
        'unknown topology (`"ring"`)',
        build("gloo_cpu", topology="ring"),
        (EngineOptionError,),
        r"topology must be one of 'broadcast', 'paired'",
    ),
    Case(
        "checksum-not-bool",
        '`checksum="yes"`',
        build("gloo_cpu", checksum="yes"),
        (EngineOptionError,),
        r"checksum must be True or False",
    ),
    Case(
        "auth-token-empty",
        "empty `auth_token`",
        build("gloo_cpu", auth_token=""),
        (EngineOptionError,),
        r"auth_token must be a non-empty string",
    ),
    Case(
        "auth-token-not-str",
        "`auth_token` that is not a string",
        build("gloo_cpu", auth_token=1234),
        (EngineOptionError,),
        r"auth_token must be a non-empty string",
    ),
    Case("host-empty", "empty `host`", build("gloo_cpu", host=""), (EngineOptionError,), r"host must be a non-empty"),
    Case(
        "host-not-local",
        "`host` that is no address of this machine (`192.0.2.1`)",
        lambda _: engine(host="192.0.2.1").prepare(),
        (EngineOptionError,),
        r"cannot listen on host='192.0.2.1'",
    ),
    Case(
        "ipc-device-unknown",
        'cuda_ipc `device="tpu"`',
        build("cuda_ipc", device="tpu"),
        (EngineOptionError,),
        r"device must be 'cpu', 'cuda' or 'cuda:N'",
    ),
    Case(
        "ipc-device-cuda-without-gpu",
        'cuda_ipc `device="cuda"` on a machine without a GPU',
        build("cuda_ipc", device="cuda"),
        (BackendUnavailableError,),
        r"needs a CUDA device",
        needs="without_cuda",
    ),
    Case(
        "ipc-socket-dir-missing",
        "cuda_ipc `socket_dir` that does not exist",
        lambda tmp: engine("cuda_ipc", socket_dir=str(tmp / "missing")),
        (EngineOptionError,),
        r"is not an existing directory",
    ),
    Case(
        "ipc-socket-dir-too-long",
        "cuda_ipc `socket_dir` too long for a Unix socket path",
        lambda tmp: engine("cuda_ipc", socket_dir=str(_long_dir(tmp))),
        (EngineOptionError,),
        r"too long for a Unix socket path",
    ),
    Case(
        "nccl-without-gpu",
        "the nccl backend on a machine without a GPU",
        build("nccl"),
        (BackendUnavailableError,),
        r"cannot run here",
        needs="without_cuda",
    ),
    # lifecycle order
    Case(
        "init-before-prepare",
        "init before `prepare()`",
        lambda _: init_policy(engine(), []),
        (LifecycleError,),
        r"needs the engine to be prepared, but it is new",
    ),
    Case(
        "prepare-twice",
        "`prepare()` twice",
        with_prepared(lambda e, _: e.prepare()),
        (LifecycleError,),
        r"prepare\(\) needs the engine to be new",
    ),
    Case(
        "receive-before-init",
        "receive before init",
        with_prepared(lambda e, _: receive(e)),
        (LifecycleError,),
        r"receive_weight_batches\(\) needs the engine to be rollout",
    ),
    Case(
        "send-before-init",
        "send before init",
        with_prepared(lambda e, _: send(e, [("w", tensor())])),
        (LifecycleError,),
        r"send_weights\(\) needs the engine to be policy",
    ),
    Case(
        "init-twice",
        "init twice",
        on_pair(lambda p: init_rollout(p.rollout, [])),
        (LifecycleError,),
        r"needs the engine to be prepared, but it is initialized as a rollout",
    ),
    Case(
        "receive-on-policy",
        "receive on a policy engine",
        on_pair(lambda p: receive(p.policy)),
        (LifecycleError,),
        r"needs the engine to be rollout, but it is initialized as a policy",
    ),
    Case(
        "send-on-rollout",
        "send on a rollout engine",
        on_pair(lambda p: send(p.rollout, [("w", tensor())])),
        (LifecycleError,),
        r"needs the engine to be policy, but it is initialized as a rollout",
    ),
    Case(
        "send-after-finalize",
        "send after `finalize()`",
        on_pair(refit_then(finalize_then_send)),
        (LifecycleError,),
        r"send_weights\(\) needs the engine to be policy, but it is new",
    ),
    Case(
        "two-sends-at-once",
        "two `send_weights` at once on one engine (`asyncio.gather`)",
        on_pair(two_sends_at_once),
        (LifecycleError,),
        r"a refit is already in progress on this engine",
    ),
    Case(
        "send-after-failed-refit",
        "a refit after a failed one, without finalize/prepare/init",
        on_pair(failed_refit_then_send),
        (LifecycleError,),
        r"failed \(a refit failed: call finalize\(\), then prepare\(\)",
    ),
    # ranks, sizes and metadata
    Case(
        "metadata-wrong-length",
        "metadata list of the wrong length",
        with_prepared(lambda e, m: init_policy(e, [m])),
        OURS_AND_VALUE,
        r"metadata must be a list of 2 prepare\(\) results",
    ),
    Case(
        "metadata-not-list",
        "metadata that is not a list",
        with_prepared(lambda e, m: init_policy(e, {"0": m})),
        OURS_AND_VALUE,
        r"metadata must be a list of 2",
    ),
    Case(
        "metadata-entry-not-mapping",
        "a metadata entry that is not a mapping",
        with_prepared(lambda e, m: init_policy(e, [m, "rollout"])),
        (WireFormatError,),
        r"metadata\[1\].*(mapping|dict|JSON object)",
    ),
    Case(
        "metadata-other-backend",
        "a metadata entry from another backend",
        with_prepared(lambda e, m: init_policy(e, [m, other(m, backend="cuda_ipc")])),
        (WireFormatError,),
        r"metadata\[1\] comes from backend 'cuda_ipc', not 'gloo_cpu'",
    ),
    Case(
        "metadata-other-format",
        "a metadata entry of another format version",
        with_prepared(lambda e, m: init_policy(e, [m, other(m, format=FORMAT_VERSION + 1)])),
        (WireFormatError,),
        rf"metadata\[1\] has format {FORMAT_VERSION + 1}, this side speaks {FORMAT_VERSION}",
    ),
    Case(
        "metadata-wrong-order",
        "metadata entries in the wrong order (rollout's first)",
        with_prepared(lambda e, m: init_policy(e, [other(m), m])),
        OURS_AND_VALUE,
        r"metadata\[0\] is not this engine's prepare\(\) result",
    ),
    Case(
        "metadata-bad-port",
        "policy rank 0's entry with an invalid rendezvous port",
        with_prepared(lambda e, m: init_rollout(e, [other(m, port=0), m])),
        (WireFormatError,),
        r"policy rank 0's metadata has no valid port: 0",
    ),
    *[
        Case(
            f"rank-{label}",
            f"`worker_rank={value!r}` with 2 policy ranks",
            with_prepared(_init_as_rank(value)),
            OURS_AND_VALUE,
            r"worker_rank must be an int in \[0, 2\)",
        )
        for label, value in (("negative", -1), ("too-large", 2), ("bool", True))
    ],
    Case(
        "rollout-rank-too-large",
        "`rollout_rank` >= rollout world size",
        with_prepared(lambda e, m: init_rollout(e, [other(m), m], rank=1)),
        OURS_AND_VALUE,
        r"rollout_rank must be an int in \[0, 1\)",
    ),
    *[
        Case(
            f"world-size-{label}",
            f"`train_world_size={value!r}`",
            with_prepared(_init_with_train_size(value)),
            OURS_AND_VALUE,
            r"train_world_size must be an int >= 1",
        )
        for label, value in (("0", 0), ("negative", -1), ("float", 1.0))
    ],
    Case(
        "paired-too-few-policy",
        "paired topology with fewer policy than rollout ranks",
        with_prepared(lambda e, m: init_policy(e, [m, other(m), other(m)], rollout=2), topology="paired"),
        (EngineOptionError,),
        r"needs at least as many policy ranks as rollout ranks",
    ),
    Case(
        "ipc-bucket-size-mismatch",
        "cuda_ipc workers with different bucket sizes",
        lambda _: _ipc_bucket_mismatch(),
        (EngineOptionError,),
        r"uses bucket_size 8192, this worker 4096",
    ),
    # weights
    Case(
        "weight-not-tensor",
        "a weight that is not a tensor",
        bad_weights(lambda: [("w", tensor()), ("x", [1, 2])]),
        (UnsupportedTensorError,),
        r"weight 'x' is a list, not a torch.Tensor",
    ),
    Case(
        "name-not-str",
        "a weight name that is not a string",
        bad_weights(lambda: [(7, tensor())]),
        (UnsupportedTensorError,),
        r"weight names must be strings, got int 7",
    ),
    Case(
        "item-not-pair",
        "an item that is not a `(name, tensor)` pair",
        bad_weights(lambda: [("w", tensor(), 1)]),  # type: ignore[list-item]
        (UnsupportedTensorError,),
        r"must yield \(name, tensor\) pairs",
    ),
    Case(
        "duplicate-name",
        "the same name twice in one refit",
        bad_weights(lambda: [("w", tensor()), ("w", tensor())]),
        (UnsupportedTensorError,),
        r"weight name 'w' appears twice in one refit",
    ),
    Case(
        "quantized",
        "a quantized tensor",
        bad_weights(lambda: [("q", _quantized())]),
        (UnsupportedTensorError,),
        r"weight 'q' is quantized \(qint8\)",
    ),
    Case(
        "sparse",
        "a sparse tensor",
        bad_weights(lambda: [("s", torch.eye(4).to_sparse())]),
        (UnsupportedTensorError,),
        r"weight 's' has layout torch.sparse_coo.*to_dense",
    ),
    Case(
        "meta-device",
        "a meta-device tensor",
        bad_weights(lambda: [("m", torch.empty(4, device="meta"))]),
        (UnsupportedTensorError,),
        r"weight 'm' is on the meta device",
    ),
    # bytes from a peer
    Case(
        "header-other-version",
        "a bucket header of another format version",
        decode(header_bytes(format=FORMAT_VERSION + 1)),
        (WireFormatError,),
        rf"format version {FORMAT_VERSION + 1}, this side speaks {FORMAT_VERSION}",
    ),
    Case(
        "header-truncated",
        "a truncated bucket header",
        decode(header_bytes()[:-7]),
        (WireFormatError,),
        r"not valid JSON.*truncated or corrupt",
    ),
    Case(
        "header-payload-too-big",
        "a header announcing more bytes than a bucket holds",
        decode(header_bytes(nbytes=BUCKET + 1)),
        (WireFormatError,),
        r"exceeds the bucket size 4096",
    ),
    Case(
        "header-chunk-outside",
        "a header placing a chunk outside the payload",
        decode(header_bytes(offsets=[8])),
        (WireFormatError,),
        r"lies outside the 16-byte payload",
    ),
    Case(
        "meta-unknown-dtype",
        "tensor metadata with an unknown dtype",
        meta_dict(dtype="float99"),
        (WireFormatError,),
        r"unknown dtype 'float99'",
    ),
    Case(
        "meta-negative-dim",
        "tensor metadata with a negative dimension",
        meta_dict(shape=[-4]),
        (WireFormatError,),
        r"shape must be a list of ints >= 0",
    ),
    Case("chunk-gap", "a chunk stream with a gap", merge_with_gap, (ChunkStreamError,), r"gap in chunk stream"),
    # peers that should not be let in
    Case(
        "auth-wrong-token",
        "a peer with the wrong `auth_token`",
        auth("secret-a", "secret-b"),
        (AuthenticationError,),
        r"refused at rendezvous: rollout rank 0 \(wrong token\)",
    ),
    Case(
        "auth-token-policy-only",
        "`auth_token` on the policy only",
        auth("secret-a", None),
        (AuthenticationError,),
        r"rollout rank 0 \(it has no token\)",
    ),
    Case(
        "auth-token-rollout-only",
        "`CKPT_CORE_AUTH_TOKEN` on the rollout only",
        auth(None, "secret-b", rollout_env=True),
        (AuthenticationError,),
        r"rollout rank 0 \(it has a token, this host has none\)",
    ),
    # coordinator
    Case(
        "coordinator-refit-before-setup",
        "`RefitCoordinator.refit()` before `setup()`",
        lambda _: RefitCoordinator(_NoCallsPool(2), num_policy=1, num_rollout=1).refit(),  # type: ignore[arg-type]
        (LifecycleError,),
        r"setup\(\)",
    ),
    Case(
        "coordinator-no-rollout",
        "a coordinator with 0 rollout workers",
        lambda _: RefitCoordinator(_NoCallsPool(1), num_policy=1, num_rollout=0),  # type: ignore[arg-type]
        OURS_AND_VALUE,
        r"rollout",
    ),
]


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch; users still have them
        return torch.quantize_per_tensor(tensor(8), 0.1, 0, torch.qint8)


def _long_dir(tmp: Path) -> Path:
    path = tmp / ("d" * 90)
    path.mkdir(exist_ok=True)
    return path


def _ipc_bucket_mismatch() -> None:
    policy = engine("cuda_ipc", bucket_size=2 * BUCKET)
    rollout = engine("cuda_ipc")
    try:
        metadata = [policy.prepare(), rollout.prepare()]
        init_rollout(rollout, metadata)
    finally:
        policy.finalize()
        rollout.finalize()


def run_case(case: Case, tmp_path: Path) -> BaseException | None:
    """The exception ``case`` raises (``None`` if it raised nothing)."""
    try:
        case.run(tmp_path)
    except BaseException as exc:  # noqa: BLE001 - the object under test
        return exc
    return None


def check(case: Case, error: BaseException | None) -> str | None:
    """What is wrong with ``error`` as ``case``'s outcome, or ``None``."""
    wanted = " and ".join(t.__name__ for t in case.expect)
    if error is None:
        return f"{case.what}: no error was raised (expected {wanted})"
    got = f"{type(error).__module__}.{type(error).__name__}: {error}"
    missing = [t.__name__ for t in case.expect if not isinstance(error, t)]
    if missing:
        return f"{case.what}: expected {wanted}, got {got}"
    if not re.search(case.match, str(error), re.DOTALL):
        return f"{case.what}: message does not match {case.match!r}: {got}"
    return None


def markdown_table(tmp_path: Path, cases: list[Case] | None = None) -> str:
    """The docs table: each case (of ``cases``, default ``CASES``), the error it must get, and
    (where that is not what the code raises today) what it gets instead."""
    rows = ["| # | bad input | error | message (abridged) |", "| --- | --- | --- | --- |"]
    for number, case in enumerate(CASES if cases is None else cases, 1):
        if case.needs and globals()[case.needs]() is not None:
            continue
        error = run_case(case, tmp_path)
        expected = " + ".join(f"`{t.__name__}`" for t in case.expect)
        if check(case, error) is not None:
            typed = error is not None and all(isinstance(error, t) for t in case.expect)
            got = type(error).__name__ if error is not None else "nothing"
            expected += (
                " (today: an unclear message, see the bugs below)"
                if typed
                else f" (today: `{got}`, see the bugs below)"
            )
        message = str(error).splitlines()[0] if error is not None and str(error) else ""
        message = message.replace(str(tmp_path), "<tmp>")
        message = (message[:140] + "...") if len(message) > 140 else message
        rows.append(f"| {number} | {case.what} | {expected} | {message.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        print(markdown_table(Path(tmp)))
    sys.stdout.flush()
