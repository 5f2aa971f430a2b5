"""Round two of the bad-input table: inputs found by trying harder (issue #19).

Weights whose memory is not there (freed, shrunk, fake, nested), settings that only one side
applies, sizes and timeouts past what the layers below can represent, forged headers with huge
or overflowing shapes, and ``finalize()`` in the middle of a refit. Each must get one of
ckpt-core's typed errors, like every row of :mod:`rel_bad_inputs`; the test walks every list
(``test_rel_bad_inputs.py``), and ``python -m tests.reliability.rel_round3_inputs`` prints the
rows of all of them for the docs.

Several of these crashed the process before they were fixed (SIGSEGV or SIGABRT from Gloo),
so ``run_isolated`` runs a case in a child process when checking them against old code.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_core._internal.assembly import ChunkAssembler
from ckpt_core._internal.wire import BucketHeader, decode_header, encode_header
from ckpt_core.base import TensorMeta
from ckpt_core.errors import (
    CheckpointEngineError,
    EngineOptionError,
    LifecycleError,
    OutOfMemoryError,
    RemoteRefitError,
    TransferError,
    UnsupportedTensorError,
    WireFormatError,
)
from tests.helpers.headers import header_bytes_of, header_fields
from tests.reliability.rel_bad_inputs import BUCKET, Case, build, engine, init_policy, init_rollout, tensor
from tests.reliability.rel_inprocess import Pair, concurrently

# --- weights whose memory is not there ---------------------------------------------------------


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


def nested() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def wrapper_subclass() -> torch.Tensor:
    """A wrapper tensor subclass (as DTensor is): its own storage is not its data."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.arange(1 << 16, dtype=torch.float32), torch.zeros(1 << 16))


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


# --- settings only one side applies --------------------------------------------------------------


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


# --- sizes and timeouts past what the layers below represent -----------------------------------


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


# --- finalize() during a refit ---------------------------------------------------------------------


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


IPC = {"device": "cpu"}

HOSTILE_CASES: list[Case] = [
    # point 3: weights whose memory is not there
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
        bad_weight("gloo_cpu", nested),
        (UnsupportedTensorError,),
        r"weight 'w' is a nested tensor.*unbind",
    ),
    # point 5: settings that both sides must share, set on one side only
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
    # point 6: sizes past what the layers below represent
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
    # point 6: finalize() during a refit
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
]

assert all(issubclass(t, CheckpointEngineError) for case in HOSTILE_CASES for t in case.expect)
