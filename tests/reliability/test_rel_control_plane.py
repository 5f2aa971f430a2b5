"""The control plane is safe to expose to a network peer.

* No object serialization on any socket, pipe or store: a static scan of every production
  module (``ckpt_core`` and each plugin's package) finds no pickle-family import or call.
* Every decoder of peer bytes is fuzzed and raises only its documented error type:
  ``WireFormatError`` for bucket headers, tensor metadata and cuda_ipc control frames (or
  ``PeerLostError``/``RemoteRefitError`` for a stream that ends or says the peer gave up);
  ``ValueError`` for the local launcher's JSON-lines protocol.
* ``auth_token`` (or ``CKPT_CORE_AUTH_TOKEN``) on both sides lets a refit through; the refusals
  (wrong token, token on one side) are rows of the bad-input table.
* Listening sockets bind to the configured host only.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from ckpt_core._internal.wire import BucketHeader, decode_header, encode_header
from ckpt_core.base import TensorMeta, create_checkpoint_engine
from ckpt_core.errors import PeerLostError, RemoteRefitError, TransferError, WireFormatError
from ckpt_core.orchestration import protocol
from ckpt_cuda_ipc.buffers import HostSlots
from ckpt_cuda_ipc.control import Channel, decode_json
from ckpt_cuda_ipc.transport import IpcReceiver, IpcSender
from tests.helpers.headers import header_bytes_of, header_fields
from tests.reliability.rel_inprocess import Pair
from tests.reliability.rel_net import listening_sockets
from tests.reliability.rel_pickle_scan import FORBIDDEN_METHODS, production_modules, scan, scan_source
from tests.reliability.rel_team import REPO, Team

FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
BUCKET = 4096

# --- no pickle anywhere ------------------------------------------------------------------------

ALLOWED: dict[str, str] = {}
"""``"path:line: what"`` -> why it is safe. Empty: there is no exception today. (Out of the
scan's reach by design: Ray serializes the JSON text ``ckpt_core.orchestration.ray`` hands it, inside Ray's
own trusted cluster channel; see docs/reliability.md.)"""


def test_no_production_module_serializes_python_objects() -> None:
    modules = production_modules(REPO)
    assert len(modules) > 20 and any("ckpt_cuda_ipc" in str(m) for m in modules), "the scan must cover every plugin"
    findings = [f for f in scan(REPO) if f"{f.path}:{f.line}: {f.what}" not in ALLOWED]
    assert not findings, "object serialization in production code:\n" + "\n".join(map(str, findings))


def test_the_scan_finds_each_forbidden_pattern() -> None:
    """The scan itself can fail: every pattern it looks for, spelled several ways, is found."""
    source = """
import pickle
import cloudpickle as cp
from dill import loads
import marshal
from multiprocessing import Pipe
import multiprocessing.connection
import torch as T
from torch import load
import torch.distributed as dist
import numpy as np
import yaml
from multiprocessing import shared_memory  # allowed: raw bytes

T.save({}, "x")
load("x")
np.load("x", allow_pickle=True)
yaml.load("x")
eval("1")
sock.send_pyobj(1)
dist.broadcast_object_list([1])
"""
    found = {f.what for f in scan_source(source, "synthetic.py")}
    expected = {
        "import pickle",
        "import cloudpickle",
        "from dill import loads",
        "import marshal",
        "from multiprocessing import Pipe",
        "import multiprocessing.connection",
        "call torch.save()",
        "call torch.load()",
        "call numpy.load()",
        "call yaml.load()",
        "call eval()",
        "call .send_pyobj()",
        "call .broadcast_object_list()",
    }
    assert expected <= found, f"missed: {sorted(expected - found)}"
    assert not any("shared_memory" in f for f in found)
    assert "recv_object_list" in FORBIDDEN_METHODS


# --- decoders of peer bytes, fuzzed --------------------------------------------------------


def _valid_header() -> bytes:
    chunks = (
        TensorMeta("layer.0.weight", torch.Size([4, 3]), torch.bfloat16, 0, 24, 0),
        TensorMeta("layer.0.bias", torch.Size([7]), torch.float32, 8, 20, 24),
    )
    return encode_header(BucketHeader(3, 1, 44, False, chunks, 0xDEADBEEF))


VALID_HEADER = _valid_header()
HEADER_FIELDS = sorted(header_fields(VALID_HEADER))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Integers near the edges that matter: negative, 0, int64 and uint64 bounds, beyond them.
edgy_ints = st.sampled_from([-1, 0, 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 2**70]) | st.integers()


def expect_only(error_types: tuple[type[BaseException], ...], function: Any, *args: Any) -> Any:
    """Run ``function``; an exception outside ``error_types`` fails the test, naming it."""
    try:
        return function(*args)
    except error_types:
        return None
    except Exception as exc:  # noqa: BLE001 - this is what the test reports
        raise AssertionError(
            f"{getattr(function, '__qualname__', function)} raised {type(exc).__name__}: {exc} "
            f"(only {', '.join(t.__name__ for t in error_types)} is documented) for input {args!r:.300}"
        ) from exc


def assert_usable(meta: TensorMeta) -> None:
    """A decoded ``TensorMeta`` is safe to build a tensor from: anything a peer may announce
    that cannot be built must be refused at decoding, as WireFormatError."""
    try:
        assert meta.nbytes >= 0
        torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    except Exception as exc:  # noqa: BLE001 - this is what the test reports
        raise AssertionError(
            f"decoding accepted {meta.name!r} with shape {list(meta.shape)}, but no tensor can be built from "
            f"it ({type(exc).__name__}: {str(exc).splitlines()[0]}); it must be refused with WireFormatError"
        ) from exc


def decode_header_checked(raw: bytes) -> None:
    header = decode_header(raw, bucket_size=BUCKET)
    for meta in header.chunks:
        assert_usable(meta)


def from_dict_checked(data: Any) -> None:
    assert_usable(TensorMeta.from_dict(data))


@FUZZ
@given(st.binary(max_size=1024))
@example(b"[" * 3000)
@example(b"")
@example(VALID_HEADER[:-1])
def test_decode_header_random_bytes(data: bytes) -> None:
    expect_only((WireFormatError,), decode_header_checked, data)


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(["flip", "delete", "insert", "cut"]), st.integers(0, 10**6), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    )
)
def test_decode_header_mutated_bytes(edits: list[tuple[str, int, int]]) -> None:
    data = bytearray(VALID_HEADER)
    for op, where, byte in edits:
        at = where % (len(data) + 1)
        if op == "flip" and at < len(data):
            data[at] ^= byte or 1
        elif op == "delete" and at < len(data):
            del data[at]
        elif op == "insert":
            data.insert(at, byte)
        elif op == "cut":
            del data[at:]
    expect_only((WireFormatError,), decode_header_checked, bytes(data))


@FUZZ
@given(st.sampled_from(HEADER_FIELDS), json_values | edgy_ints, st.booleans())
@example("shapes", [[2**70, 0], [7]], False)
@example("shapes", 2**70, True)
@example("nbytes", 2**64, False)
def test_decode_header_with_any_json_value_in_any_field(field: str, value: Any, inside: bool) -> None:
    """Replace one field (or, for the per-chunk columns, its first entry) with any JSON value."""
    doc = header_fields(VALID_HEADER)
    if inside and isinstance(doc[field], list) and doc[field]:
        doc[field][0] = value
    else:
        doc[field] = value
    raw = header_bytes_of(doc)
    expect_only((WireFormatError,), decode_header_checked, raw)


META_KEYS = ["name", "shape", "dtype", "chunk_offset", "chunk_size", "offset"]


@FUZZ
@given(st.dictionaries(st.sampled_from(META_KEYS + ["extra"]), json_values | edgy_ints, max_size=7) | json_values)
@example({"name": "w", "shape": [2**70, 0], "dtype": "float32", "chunk_offset": 0, "chunk_size": 0, "offset": 0})
@example({"name": "w", "shape": [2**63], "dtype": "bool", "chunk_offset": 0, "chunk_size": 0, "offset": 0})
def test_tensor_meta_from_any_json(data: Any) -> None:
    decoded = json.loads(json.dumps(data))
    expect_only((WireFormatError,), from_dict_checked, decoded)


@FUZZ
@given(st.sampled_from(META_KEYS), json_values | edgy_ints)
def test_tensor_meta_with_any_value_in_one_field(key: str, value: Any) -> None:
    data = TensorMeta("w", torch.Size([4, 3]), torch.float16, 0, 24, 0).to_dict()
    data[key] = value
    expect_only((WireFormatError,), from_dict_checked, json.loads(json.dumps(data)))


@FUZZ
@given(st.binary(max_size=512) | st.builds(lambda v: json.dumps(v).encode(), json_values))
@example(b"[" * 3000)
@example(b"\xff\xfe")
def test_launcher_protocol_decode(line: bytes) -> None:
    """The local launcher's JSON-lines decoder raises ``ValueError`` (of which
    ``json.JSONDecodeError`` and ``UnicodeDecodeError`` are kinds) for anything malformed."""
    expect_only((ValueError,), protocol.decode, line)


@pytest.fixture(scope="module")
def host_slots() -> Iterator[HostSlots]:
    slots = HostSlots.allocate(BUCKET, 2)
    yield slots
    slots.close()


def frames(draw_frames: list[tuple[int, bytes]]) -> bytes:
    return b"".join(struct.pack("!BI", kind, len(body)) + body for kind, body in draw_frames)


control_bodies = (
    st.binary(max_size=64)
    | st.builds(lambda v: json.dumps(v).encode(), json_values)
    | st.builds(
        lambda t, r: json.dumps({"type": t, "reason": r}).encode(),
        st.sampled_from(["bye", "error", "hello", "x"]),
        st.text(max_size=8),
    )
    | st.just(VALID_HEADER)
)
frame_streams = st.lists(st.tuples(st.integers(0, 6), control_bodies), max_size=5).map(frames)
byte_streams = frame_streams | st.binary(max_size=256) | st.builds(bytes.__add__, frame_streams, st.binary(max_size=16))


def _fed_channel(data: bytes) -> tuple[Channel, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.sendall(data)
    theirs.close()  # the peer goes away after its bytes: every read ends
    return Channel(ours, "fuzzing peer"), ours


@FUZZ
@given(byte_streams)
@example(struct.pack("!BI", 2, 2**32 - 1))
@example(struct.pack("!BI", 9, 0))
def test_cuda_ipc_rollout_side_control_frames(host_slots: HostSlots, data: bytes) -> None:
    """What a rollout reads from the policy's control socket: frames, control messages,
    headers. Only WireFormatError, or PeerLostError/RemoteRefitError (the stream ended, or
    said the refit is void), may come out."""
    channel, sock = _fed_channel(data)
    receiver = IpcReceiver(host_slots, channel, timeout_s=5.0)
    try:
        for _ in range(10):
            raw = expect_only((WireFormatError, PeerLostError, RemoteRefitError), receiver.recv_header, 5.0)
            if raw is None:
                break
            expect_only((WireFormatError,), decode_header_checked, raw)
    finally:
        sock.close()


@FUZZ
@given(byte_streams)
def test_cuda_ipc_policy_side_control_frames(host_slots: HostSlots, data: bytes) -> None:
    """What the policy reads from a rollout while waiting for slot releases."""
    channel, sock = _fed_channel(data)
    sender = IpcSender(host_slots, [channel], wait_for_peers_on_close=False)
    sender._pending[0] = {0}  # as after posting slot 0 to rollout 0
    try:
        expect_only((WireFormatError, TransferError), sender.wait_slot, 0, 5.0)
    finally:
        sock.close()


@FUZZ
@given(st.binary(max_size=256) | st.builds(lambda v: json.dumps(v).encode(), json_values))
def test_cuda_ipc_decode_json(body: bytes) -> None:
    message = expect_only((WireFormatError,), decode_json, body, "fuzzing peer")
    assert message is None or (isinstance(message, dict) and isinstance(message["type"], str))


# --- authentication: the accepted cases (refusals are rows of the bad-input table) -------------


def _refit_through(pair: Pair) -> None:
    for outcome in pair.init_outcomes:
        outcome.get()
    weights = [("w", torch.arange(5000, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    sent, received = pair.refit(lambda: weights)
    sent.get()
    assert [(n, t.dtype, t.tolist()) for n, t in received.get()] == [(n, t.dtype, t.tolist()) for n, t in weights]


def test_the_same_auth_token_on_both_sides_lets_the_refit_through() -> None:
    pair = Pair(engine_kwargs={"auth_token": "shared secret \u00e9"})
    try:
        _refit_through(pair)
    finally:
        pair.finalize()


def test_the_same_token_from_the_environment_lets_the_refit_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CORE_AUTH_TOKEN", "from-the-environment")
    pair = Pair()
    try:
        _refit_through(pair)
    finally:
        pair.finalize()


def test_the_option_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CORE_AUTH_TOKEN", "environment token")
    pair = Pair(policy_kwargs={"auth_token": "option token"})
    try:
        assert isinstance(pair.init_outcomes[0].error, PermissionError), pair.init_outcomes[0].error
    finally:
        pair.finalize()


# --- listening sockets bind where they are told ------------------------------------------------


def _new_listeners(before: list[str]) -> list[str]:
    return sorted(set(listening_sockets(os.getpid())) - set(before))


def test_prepare_binds_the_configured_host_and_listens_on_nothing() -> None:
    """prepare() reserves its rendezvous port on ``host`` without listening: until policy rank
    0 serves the store at init, a connection is refused (a peer retries until its deadline)
    instead of waiting in a backlog nobody reads."""
    before = listening_sockets(os.getpid())
    engine = create_checkpoint_engine(
        "gloo_cpu", bucket_size_bytes=BUCKET, engine_kwargs={"host": "127.0.0.1", "timeout_s": 20}
    )
    try:
        metadata = engine.prepare()
        assert _new_listeners(before) == [], "prepare() must not listen"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", metadata["port"]), timeout=5).close()
        other = socket.socket()
        with other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", metadata["port"]))  # the port is this worker's
    finally:
        engine.finalize()
    free = socket.socket()
    with free:
        free.bind(("127.0.0.1", metadata["port"]))  # finalize() released it


@pytest.mark.slow
def test_workers_listen_on_the_configured_host_only(team: Team) -> None:
    """After a whole set-up and a refit, every TCP socket the worker processes listen on (the
    rendezvous store, Gloo's pair listeners) is on 127.0.0.1; cuda_ipc listens on none."""
    for backend, options in (("gloo_cpu", {"host": "127.0.0.1"}), ("cuda_ipc", {"device": "cpu"})):
        coordinator = team.coordinator(
            policy=[0], rollout=[1], backend=backend, bucket_size=64 << 10, engine_kwargs={**options, "timeout_s": 30}
        )
        coordinator.setup()
        coordinator.refit()
        listeners = {label: listening_sockets(team.pid(slot)) for label, slot in (("policy", 0), ("rollout", 1))}
        coordinator.finalize()
        if backend == "gloo_cpu":
            assert listeners["policy"], "policy rank 0 hosts the rendezvous store: it must listen somewhere"
            stray = {label: [a for a in found if not a.startswith("127.0.0.1:")] for label, found in listeners.items()}
            assert stray == {"policy": [], "rollout": []}, f"listening beyond 127.0.0.1: {stray}"
        else:
            assert listeners == {"policy": [], "rollout": []}, f"cuda_ipc opened TCP listeners: {listeners}"
