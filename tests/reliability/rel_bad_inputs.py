"""Bad inputs and the errors they must get: one table of :class:`Case` rows, grouped by what
they test (the tables of ``docs/reliability.md``, in the same order):

* :data:`BACKEND_CASES`: backend names and ``module:Class`` targets;
* :data:`OPTION_CASES`: option values one engine refuses (at construction, or at init where a
  value meets the machine: an address, a size past what the layers below represent);
* :data:`INIT_CASES`: ranks, world sizes and metadata given to init;
* :data:`AGREEMENT_CASES`: settings and world sizes every worker must share, set otherwise on
  one side;
* :data:`PEER_CASES`: peers that must not be let in (tokens), or never come (rendezvous);
* :data:`LIFECYCLE_CASES`: calls out of order or at the wrong time, on an engine or a
  coordinator (``finalize()`` during a refit included);
* :data:`TENSOR_CASES`: weights a generator yields (not tensors, tensors without their bytes,
  memory freed or reused after it was yielded);
* :data:`WIRE_CASES`: bytes from a peer (bucket headers, tensor metadata, chunk streams).

:data:`CASES` is all of them. Each case runs in this process against real engines (a lone
engine for option, lifecycle and metadata checks; a policy/rollout :class:`~rel_inprocess.Pair`
on threads where a peer is needed) and raises the error a user would see; cases with a time
bound assert it themselves. ``test_rel_bad_inputs.py`` checks each one; ``python -m
tests.reliability.rel_bad_inputs`` prints the docs' tables from what the code raises today.
Where a new bad input goes: the group of what it tests, never a list of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ckpt_core._internal.assembly import ChunkAssembler
from ckpt_core._internal.wire import FORMAT_VERSION, BucketHeader, decode_header, encode_header
from ckpt_core.base import CheckpointEngine, TensorMeta, create_checkpoint_engine, merge_weight_chunk_batches
from ckpt_core.errors import (
    AuthenticationError,
    BackendImportError,
    BackendUnavailableError,
    CheckpointEngineError,
    ChunkStreamError,
    EngineOptionError,
    IntegrityError,
    LifecycleError,
    NotAnEngineError,
    OutOfMemoryError,
    PeerLostError,
    RemoteRefitError,
    TransferError,
    UnknownBackendError,
    UnsupportedTensorError,
    WireFormatError,
)
from ckpt_core.orchestration.coordinator import RefitCoordinator
from tests.helpers.headers import header_bytes_of, header_fields
from tests.reliability.rel_inprocess import Pair, collect, concurrently

BUCKET = 4096
IPC = {"device": "cpu"}
"""cuda_ipc's engine options here: shared host memory, no GPU."""


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


OURS_AND_VALUE = (CheckpointEngineError, ValueError)
"""Expected of argument errors that today raise a bare ValueError: one of our types (the
caller can catch ``CheckpointEngineError``) that still is a ``ValueError``."""


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


def without_cuda() -> str | None:
    return "a machine without CUDA" if torch.cuda.is_available() else None


RENDEZVOUS_TIMEOUT_S = 3.0
MARGIN_S = 2.5
"""What a bounded rendezvous may take beyond its ``timeout_s`` on a busy two-core machine."""


def within(seconds: float, limit: float, what: str) -> None:
    assert seconds < limit, f"{what} took {seconds:.1f}s, over its bound of {limit:.1f}s: a wait without deadline"


def rollout_alone(policy_entry: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Callable[[Path], Any]:
    """A rollout's init while policy rank 0 was prepared but never serves its rendezvous (it
    never calls init, or its init failed before serving, or it is stopped); ``policy_entry``
    forges policy rank 0's metadata entry instead. Must fail within ``timeout_s`` plus a
    margin, saying how long it tried."""

    def run(_: Path) -> Any:
        options: dict[str, Any] = {"timeout_s": RENDEZVOUS_TIMEOUT_S}
        policy, rollout = engine(**options), engine(**options)
        try:
            entries = [policy.prepare(), rollout.prepare()]
            if policy_entry is not None:
                entries[0] = policy_entry(entries[0])
            start = time.monotonic()
            (outcome,) = concurrently(lambda: init_rollout(rollout, entries, train=1, rollout=1), hang_s=30)
            within(time.monotonic() - start, RENDEZVOUS_TIMEOUT_S + MARGIN_S, "the rollout's init")
            raise outcome.error or AssertionError("the rollout's init succeeded without its policy")
        finally:
            policy.finalize()
            rollout.finalize()

    return run


# --- backend names and module:Class targets ----------------------------------------------------

BACKEND_CASES: list[Case] = [
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
]


# --- option values ---------------------------------------------------------------------------


def _long_dir(tmp: Path) -> Path:
    path = tmp / ("d" * 90)
    path.mkdir(exist_ok=True)
    return path


def init_pair(backend: str, bucket_size: int, **options: Any) -> Callable[[Path], Any]:
    """Initialize a pair; the first init error (policy's, else rollout's) is the case's."""

    def run(_: Path) -> Any:
        pair = Pair(backend, bucket_size=bucket_size, engine_kwargs=options)
        try:
            errors = [outcome.error for outcome in pair.init_outcomes if outcome.error is not None]
            if errors:
                raise errors[0]
        finally:
            pair.finalize()

    return run


OPTION_CASES: list[Case] = [
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
    # sizes and timeouts past what the layers below represent
    Case(
        "bucket-size-huge",
        "a bucket of 2^62 bytes (gloo_cpu)",
        init_pair("gloo_cpu", 1 << 62),
        (OutOfMemoryError,),
        r"cannot allocate 2 bucket buffers of 4611686018427387904 bytes.*lower bucket_size_bytes",
    ),
    Case(
        "ipc-bucket-size-huge",
        "a bucket of 2^62 bytes (cuda_ipc)",
        init_pair("cuda_ipc", 1 << 62, **IPC),
        (OutOfMemoryError,),
        r"cannot reserve \d+ bytes of shared memory.*lower bucket_size_bytes",
    ),
    *[
        Case(
            f"timeout-huge-{label}",
            f"`timeout_s={value!r}`",
            build("gloo_cpu", timeout_s=value),
            (EngineOptionError,),
            r"timeout_s must be at most 2.592e\+06",
        )
        for label, value in (("1e300", 1e300), ("9.3e9", 9.3e9))
    ],
]


# --- ranks, world sizes and metadata given to init -----------------------------------------------


def _init_as_rank(rank: Any) -> Callable[[CheckpointEngine, dict[str, Any]], Any]:
    """Init as policy ``rank`` of 2 (a case per bad rank)."""
    return lambda e, m: init_policy(e, [m, other(m), other(m)], rank=rank, train=2)


def _init_with_train_size(train: Any) -> Callable[[CheckpointEngine, dict[str, Any]], Any]:
    """Init with ``train_world_size=train`` (a case per bad size)."""
    return lambda e, m: init_policy(e, [m, other(m)], train=train)


def metadata_entry(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[Path], Any]:
    """The rollout's metadata entry altered by ``change`` before a policy's init sees it."""

    def run(_: Path) -> Any:
        policy, rollout = engine(), engine()
        try:
            entries = [policy.prepare(), rollout.prepare()]
            entries[1] = change(entries[1])
            init_policy(policy, entries, train=1, rollout=1)
        finally:
            policy.finalize()
            rollout.finalize()

    return run


def nested_dict(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {}
    top = node
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    return top


INIT_CASES: list[Case] = [
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
        "metadata-not-json",
        "a metadata entry holding a value that is not JSON data (`engine_id` of bytes)",
        metadata_entry(lambda entry: {**entry, "engine_id": entry["engine_id"].encode()}),
        (WireFormatError,),
        r"metadata\[1\] is not plain JSON data: \['engine_id'\] is a bytes",
    ),
    Case(
        "metadata-nested-deep",
        "a metadata entry nested ~990 levels deep (a forged layout `json.loads` accepts)",
        metadata_entry(lambda entry: {**entry, "weight_layout": nested_dict(990)}),
        (WireFormatError,),
        r"metadata\[1\] is not plain JSON data: .* is nested deeper than 32 levels",
    ),
    Case(
        "rendezvous-host-huge",
        "policy rank 0's metadata naming a 20 MB host",
        rollout_alone(lambda entry: {**entry, "host": "h" * (20 << 20)}),
        (WireFormatError,),
        r"policy rank 0's metadata has no valid host: 'hhh.*\(20971520 characters\)",
    ),
]


# --- settings every worker must share, set otherwise on one side ---------------------------------


def _ipc_bucket_mismatch() -> None:
    policy = engine("cuda_ipc", bucket_size=2 * BUCKET)
    rollout = engine("cuda_ipc")
    try:
        metadata = [policy.prepare(), rollout.prepare()]
        init_rollout(rollout, metadata)
    finally:
        policy.finalize()
        rollout.finalize()


def both_refuse(
    backend: str, policy: dict[str, Any], rollout: dict[str, Any], bucket_sizes: tuple[int, int] = (BUCKET, BUCKET)
) -> Callable[[Path], Any]:
    """Policy and rollout built with different options: both inits must fail at once with
    EngineOptionError (no connection made, no timeout waited out); the rollout's is the case's."""

    def run(_: Path) -> Any:
        common = {"timeout_s": 20}
        engines = (
            engine(backend, bucket_sizes[0], **common, **policy),
            engine(backend, bucket_sizes[1], **common, **rollout),
        )
        pair = Pair.of(*engines)
        try:
            policy_outcome, rollout_outcome = pair.init_outcomes
            assert isinstance(policy_outcome.error, EngineOptionError), f"the policy got {policy_outcome.error!r}"
            raise rollout_outcome.error or AssertionError("the rollout accepted the policy's settings")
        finally:
            pair.finalize()

    return run


def world_sizes_disagree(backend: str, **options: Any) -> Callable[[Path], Any]:
    """The policy is told of 1 rollout rank, the rollout of 2 (its list has a third entry):
    both must fail at once naming the world sizes."""

    def run(_: Path) -> Any:
        policy, rollout = engine(backend, **options), engine(backend, **options)
        try:
            entries = [policy.prepare(), rollout.prepare()]
            ghost = {**entries[1], "engine_id": uuid.uuid4().hex}
            policy_outcome, rollout_outcome = concurrently(
                lambda: init_policy(policy, entries, train=1, rollout=1),
                lambda: init_rollout(rollout, [*entries, ghost], train=1, rollout=2),
            )
            assert isinstance(policy_outcome.error, EngineOptionError), f"the policy got {policy_outcome.error!r}"
            raise rollout_outcome.error or AssertionError("the rollout accepted the policy's world sizes")
        finally:
            policy.finalize()
            rollout.finalize()

    return run


AGREEMENT_CASES: list[Case] = [
    Case(
        "ipc-bucket-size-mismatch",
        "cuda_ipc workers with different bucket sizes",
        lambda _: _ipc_bucket_mismatch(),
        (EngineOptionError,),
        r"uses bucket_size 8192, this worker 4096",
    ),
    Case(
        "checksum-rollout-only",
        "`checksum=True` on the rollout only (gloo_cpu)",
        both_refuse("gloo_cpu", {}, {"checksum": True}),
        (EngineOptionError,),
        r"policy rank 0 uses checksum False, this worker True",
    ),
    Case(
        "ipc-checksum-rollout-only",
        "`checksum=True` on the rollout only (cuda_ipc)",
        both_refuse("cuda_ipc", IPC, {**IPC, "checksum": True}),
        (EngineOptionError,),
        r"policy rank 0 uses checksum False, this worker True",
    ),
    Case(
        "bucket-size-mismatch",
        "different bucket sizes on the two sides (gloo_cpu)",
        both_refuse("gloo_cpu", {}, {}, (2 * BUCKET, BUCKET)),
        (EngineOptionError,),
        r"policy rank 0 uses bucket_size 8192, this worker 4096.*bucket_size_bytes",
    ),
    Case(
        "topology-mismatch",
        "different topologies on the two sides",
        both_refuse("gloo_cpu", {"topology": "paired"}, {}),
        (EngineOptionError,),
        r"policy rank 0 uses topology 'paired', this worker 'broadcast'",
    ),
    Case(
        "world-size-mismatch",
        "different world sizes on the two sides (gloo_cpu)",
        world_sizes_disagree("gloo_cpu"),
        (EngineOptionError,),
        r"policy rank 0 uses rollout_world_size 1, this worker 2",
    ),
    Case(
        "ipc-world-size-mismatch",
        "different world sizes on the two sides (cuda_ipc)",
        world_sizes_disagree("cuda_ipc", **IPC),
        (EngineOptionError,),
        r"world sizes",
    ),
    Case(
        "shard-expert-weights-rollout-only",
        "`shard_expert_weights=True` on the rollout only (it expects its shards, the policy would send whole weights)",
        both_refuse("gloo_cpu", {}, {"shard_expert_weights": True}),
        (EngineOptionError,),
        r"policy rank 0 uses shard_expert_weights False, this worker True",
    ),
]


# --- peers that must not be let in, or never come ------------------------------------------------


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


def member_never_comes() -> Callable[[Path], Any]:
    """1 policy -> 2 rollouts; rollout rank 1 never calls init. Policy rank 0 gives up at its
    timeout, and rollout rank 0, which came, is told so: a lost peer, not a bad option."""

    def run(_: Path) -> Any:
        options: dict[str, Any] = {"timeout_s": RENDEZVOUS_TIMEOUT_S}
        engines = [engine(**options) for _ in range(3)]
        try:
            entries = [e.prepare() for e in engines]
            sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 2, "metadata": entries}
            policy, rollout0 = concurrently(
                lambda: engines[0].init_policy_process_group(worker_rank=0, **sizes),
                lambda: engines[1].init_rollout_process_group(rollout_rank=0, **sizes),
                hang_s=30,
            )
            assert isinstance(policy.error, PeerLostError), f"policy rank 0 got {policy.error!r}"
            raise rollout0.error or AssertionError("rollout rank 0 joined a rendezvous missing a member")
        finally:
            for e in engines:
                e.finalize()

    return run


PEER_CASES: list[Case] = [
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
    Case(
        "rendezvous-never-served",
        "policy rank 0 prepared but never serving its rendezvous (no init, a failed init, stopped)",
        rollout_alone(),
        (PeerLostError,),
        r"cannot reach policy rank 0's rendezvous at .*: gave up after 3\.\ds \(timeout_s=3;",
    ),
    Case(
        "rendezvous-port-closed",
        "policy rank 0's metadata naming a port nobody listens on (port 1)",
        rollout_alone(lambda entry: {**entry, "port": 1}),
        (PeerLostError,),
        r"rendezvous at 127\.0\.0\.1:1: gave up after 3\.\ds",
    ),
    Case(
        "rendezvous-member-missing",
        "a rollout rank that never calls init (the others are told policy rank 0 gave up)",
        member_never_comes(),
        (PeerLostError,),
        # Both wait timeout_s: the rollout hears policy rank 0 gave up, or gives up itself first.
        r"rollout rank 0 (cannot join: policy rank 0 gave up waiting for the other workers|failed after \d+\.\ds)",
    ),
]


# --- calls out of order or at the wrong time ------------------------------------------------------


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


def finalize_while_sending(backend: str, **options: Any) -> Callable[[Path], Any]:
    """The weights generator finalizes the policy halfway: send_weights must raise
    LifecycleError (not an AttributeError from a released group), the rollout a TransferError."""

    def run(_: Path) -> Any:
        pair = Pair(backend, engine_kwargs=options)
        try:
            for outcome in pair.init_outcomes:
                outcome.get()

            def weights() -> Any:
                for i in range(8):
                    if i == 4:
                        pair.policy.finalize()
                    yield f"w{i}", tensor(3000)

            sent, received = pair.refit(weights)
            assert isinstance(received.error, TransferError), f"the rollout got {received.error!r}"
            raise sent.error or AssertionError("send_weights went through a finalize()")
        finally:
            pair.finalize()

    return run


def finalize_while_receiving(backend: str, **options: Any) -> Callable[[Path], Any]:
    """The loader finalizes the rollout after its first batch."""

    def run(_: Path) -> Any:
        pair = Pair(backend, engine_kwargs=options)
        try:
            for outcome in pair.init_outcomes:
                outcome.get()

            async def load() -> None:
                async for _ in pair.rollout.receive_weight_batches():
                    pair.rollout.finalize()

            weights = [(f"w{i}", tensor(3000)) for i in range(8)]
            sent, received = concurrently(
                lambda: asyncio.run(pair.policy.send_weights(w for w in weights)), lambda: asyncio.run(load())
            )
            assert isinstance(sent.error, TransferError), f"the policy got {sent.error!r}"
            raise received.error or AssertionError("receive_weight_batches went through a finalize()")
        finally:
            pair.finalize()

    return run


class _NoCallsPool:
    """A pool for coordinator argument checks that happen before any worker is reached."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def call(self, calls: Any, timeout_s: float) -> Any:
        raise AssertionError("the coordinator reached a worker before checking its own state")


LIFECYCLE_CASES: list[Case] = [
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
    Case(
        "finalize-during-send",
        "`finalize()` on the policy during its refit (gloo_cpu)",
        finalize_while_sending("gloo_cpu"),
        (LifecycleError,),
        r"send_weights\(\): finalize\(\) was called during this refit",
    ),
    Case(
        "ipc-finalize-during-send",
        "`finalize()` on the policy during its refit (cuda_ipc)",
        finalize_while_sending("cuda_ipc", **IPC),
        (LifecycleError,),
        r"send_weights\(\): finalize\(\) was called during this refit",
    ),
    *[
        Case(
            f"{prefix}finalize-during-receive",
            f"`finalize()` on the rollout during its refit ({backend})",
            finalize_while_receiving(backend, **opts),
            (LifecycleError,),
            r"receive_weight_batches\(\): finalize\(\) was called during this refit",
        )
        for prefix, backend, opts in (("", "gloo_cpu", {}), ("ipc-", "cuda_ipc", IPC))
    ],
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


# --- weights a generator yields -------------------------------------------------------------------


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


def bad_weight(backend: str, make: Callable[[], torch.Tensor], **options: Any) -> Callable[[Path], Any]:
    """A refit on a live pair whose second weight is ``make()``: the policy's error is the
    case's; the rollout must get RemoteRefitError carrying it (and nothing crashes)."""

    def run(_: Path) -> Any:
        pair = Pair(backend, engine_kwargs=options)
        try:
            sent, received = pair.refit(lambda: [("ok", tensor()), ("w", make())])
            assert sent.error is not None, "the policy accepted the weight"
            assert isinstance(received.error, RemoteRefitError), f"rollout got {received.error!r}, not RemoteRefitError"
            raise sent.error
        finally:
            pair.finalize()

    return run


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch; users still have them
        return torch.quantize_per_tensor(tensor(8), 0.1, 0, torch.qint8)


def freed() -> torch.Tensor:
    """What FSDP leaves of an unsharded parameter: the tensor, its storage resized to 0."""
    weight = torch.arange(1 << 16, dtype=torch.float32)
    weight.untyped_storage().resize_(0)
    return weight


def shrunk() -> torch.Tensor:
    """A view whose storage was shrunk below it: its bytes would be heap garbage."""
    weight = torch.arange(1 << 16, dtype=torch.float32)
    view = weight[100:]
    weight.untyped_storage().resize_(1000)
    return view


def fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(1 << 16)


def nested_tensor() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def wrapper_subclass() -> torch.Tensor:
    """A wrapper tensor subclass (as DTensor is): its own storage is not its data."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.arange(1 << 16, dtype=torch.float32), torch.zeros(1 << 16))


WEIGHT_ELEMENTS = 75_000
"""300 KB float32 weights: sent direct (chunks of a quarter bucket or more) from 1 MiB buckets,
three to a bucket, so a bucket is posted only after the weight that follows it was yielded."""


def frees_previous(n: int, elements: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A fresh weight each time, freeing the one before (as leaving a per-module FSDP
    ``summon_full_params`` does) once the next is asked for."""
    previous = None
    for i in range(n):
        weight = torch.full((elements,), float(i))
        if previous is not None:
            previous.untyped_storage().resize_(0)
        yield f"w{i}", weight
        previous = weight


def refills_one_buffer(
    n: int, elements: int, first: int = 0, fresh_after: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One buffer, refilled for each weight: yields the same memory every time (from weight
    ``fresh_after`` on, a fresh tensor each time instead)."""
    buffer = torch.empty(elements)
    for i in range(n):
        if fresh_after is not None and i >= fresh_after:
            yield f"w{i}", torch.full((elements,), float(first + i))
            continue
        buffer.fill_(float(first + i))
        yield f"w{i}", buffer


def refit_outcome(
    weights: Callable[[int], Iterator[tuple[str, torch.Tensor]]], refits: int = 1, **options: Any
) -> Callable[[Path], Any]:
    """``refits`` refits on a gloo_cpu pair with 1 MiB buckets (``weights(k)`` yields refit
    ``k``'s weights); the last one must fail on both sides: the policy's error is the case's
    unless the rollout's is a corruption it caught."""

    def run(_: Path) -> Any:
        pair = Pair("gloo_cpu", bucket_size=1 << 20, engine_kwargs=options)
        try:
            for outcome in pair.init_outcomes:
                outcome.get()
            for k in range(refits):
                sent, received = pair.refit(functools.partial(weights, k))
                if k < refits - 1:
                    sent.get()
                    received.get()
            assert received.error is not None, "the rollout received the refit as if nothing were wrong"
            if isinstance(received.error, IntegrityError):
                raise received.error
            assert isinstance(received.error, RemoteRefitError), f"the rollout got {received.error!r}"
            raise sent.error or AssertionError("the policy sent the refit as if nothing were wrong")
        finally:
            pair.finalize()

    return run


def fresh_then_refilled(refit_index: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh tensors in the first refit, one refilled buffer after: a generator whose memory
    use changed between two refits of one layout."""
    if refit_index == 0:
        return ((f"w{i}", torch.full((64,), float(i))) for i in range(40))
    return refills_one_buffer(40, 64, first=100)


TENSOR_CASES: list[Case] = [
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
    # weights whose memory is not there
    *[
        Case(
            f"weight-storage-freed-{backend}",
            f"a weight whose storage was freed (`resize_(0)`, as FSDP does), {backend}",
            bad_weight(backend, freed, **opts),
            (UnsupportedTensorError,),
            r"weight 'w' views 262144 bytes of its storage, which holds 0 \(it was freed",
        )
        for backend, opts in (("gloo_cpu", {}), ("cuda_ipc", IPC))
    ],
    Case(
        "weight-storage-shrunk",
        "a weight whose storage was shrunk below its view",
        bad_weight("gloo_cpu", shrunk),
        (UnsupportedTensorError,),
        r"weight 'w' views 262144 bytes of its storage, which holds 1000",
    ),
    Case(
        "weight-fake-tensor",
        "a `FakeTensor`",
        bad_weight("gloo_cpu", fake),
        (UnsupportedTensorError,),
        r"weight 'w' \(FakeTensor\) has no data: its storage is on the meta device",
    ),
    Case(
        "weight-wrapper-subclass",
        "a wrapper tensor subclass (as DTensor is; here `TwoTensor`)",
        bad_weight("gloo_cpu", wrapper_subclass),
        (UnsupportedTensorError,),
        r"weight 'w' \(TwoTensor\) has no storage of its own.*full_tensor\(\)",
    ),
    Case(
        "weight-nested",
        "a nested tensor",
        bad_weight("gloo_cpu", nested_tensor),
        (UnsupportedTensorError,),
        r"weight 'w' is a nested tensor.*unbind",
    ),
    # weights freed or reused after they were yielded
    Case(
        "weight-freed-after-yield",
        "a generator freeing each weight once the next is asked for, weights sent direct (gloo_cpu)",
        # Which weight is caught first depends on the generator's pace: a weight that took
        # weights that took SLOW_BUCKET_S to come have their bucket posted (and storage checked) at once.
        refit_outcome(lambda k: frees_previous(12, WEIGHT_ELEMENTS)),
        (UnsupportedTensorError,),
        r"weight 'w\d+' was freed \(its storage now holds 0 bytes\) after it was yielded and before the sender read it",
    ),
    Case(
        "weight-refilled-after-yield-checksum",
        "a generator refilling one buffer, weights sent direct, `checksum=True` (digests are of the bytes as yielded)",
        # The first bucket's three weights share the buffer; later weights are fresh, so its
        # bytes change only before that bucket is posted, never while it is on the wire.
        refit_outcome(lambda k: refills_one_buffer(12, WEIGHT_ELEMENTS, fresh_after=3), checksum=True),
        (IntegrityError,),
        r"bucket 0 of refit 0 is corrupt",
    ),
    Case(
        "weights-alias-in-replay",
        "a generator whose tensors share one buffer in a repeated refit, not in the first",
        refit_outcome(fresh_then_refilled, refits=2),
        (UnsupportedTensorError,),
        r"weights 'w\d+' and 'w\d+' share memory, which the first refit of these weights did not show",
    ),
]


# --- bytes from a peer ----------------------------------------------------------------------------


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


def forged_header(shape: list[int], chunk_size: int = 16) -> bytes:
    meta = TensorMeta("w", torch.Size([4]), torch.float32, 0, 16, 0)
    doc = header_fields(encode_header(BucketHeader(0, 0, 16, True, (meta,), None)))
    doc["shapes"], doc["chunk_sizes"] = [shape], [chunk_size]
    return header_bytes_of(doc)


def land_forged(shape: list[int], chunk_size: int = 16) -> Callable[[Path], Any]:
    """A forged header decoded and planned as a receiver does (the output tensor is allocated
    when its first chunk is planned, and a small one is built from its chunk)."""

    def run(_: Path) -> Any:
        header = decode_header(forged_header(shape, chunk_size), bucket_size=BUCKET)
        assembler = ChunkAssembler()
        payload = torch.zeros(BUCKET, dtype=torch.uint8)
        for meta in header.chunks:
            assert meta.offset is not None
            assembler.plan(meta, torch.device("cpu")).fill_from(payload, meta.offset)

    return run


WIRE_CASES: list[Case] = [
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
        "header-huge-shape",
        "a forged header announcing a 2^61-byte tensor",
        land_forged([1 << 59]),
        (OutOfMemoryError,),
        r"tensor 'w' \(\[576460752303423488\], float32, 2305843009213693952 bytes\).*cannot be allocated",
    ),
    Case(
        "header-overflowing-shape",
        "a forged header with an empty shape whose strides overflow int64",
        land_forged([0, 1 << 40, 1 << 40], chunk_size=0),
        (WireFormatError,),
        r"spans \d+ bytes, over 4611686018427387904",
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
]


# --- the table ------------------------------------------------------------------------------------

GROUPS: list[tuple[str, list[Case]]] = [
    ("Backend names", BACKEND_CASES),
    ("Option values", OPTION_CASES),
    ("Ranks, world sizes and metadata at init", INIT_CASES),
    ("Settings every worker must share", AGREEMENT_CASES),
    ("Peers: tokens and rendezvous", PEER_CASES),
    ("Lifecycle calls", LIFECYCLE_CASES),
    ("Weights (tensors)", TENSOR_CASES),
    ("Bytes from a peer (wire)", WIRE_CASES),
]
"""Each group's title in the docs, and its cases."""

CASES: list[Case] = [case for _, cases in GROUPS for case in cases]

assert all(any(issubclass(t, CheckpointEngineError) for t in case.expect) for case in CASES), (
    "every bad input gets one of ckpt-core's typed errors"
)


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


def markdown_table(tmp_path: Path, groups: list[tuple[str, list[Case]]] | None = None) -> str:
    """The docs' tables, one per group (of ``groups``, default ``GROUPS``), numbered on across
    them: each case, the error it must get, and (where that is not what the code raises today)
    what it gets instead."""
    out: list[str] = []
    number = 0
    for title, cases in GROUPS if groups is None else groups:
        rows = [f"**{title}**", "", "| # | bad input | error | message (abridged) |", "| --- | --- | --- | --- |"]
        for case in cases:
            number += 1
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
        out.append("\n".join(rows))
    return "\n\n".join(out)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        print(markdown_table(Path(tmp)))
    sys.stdout.flush()
