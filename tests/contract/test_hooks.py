"""Observer hooks, and the refit pipeline they observe.

* A hook object registered at run time sees every stage of real refits (both roles).
* The shared pipeline (``ckpt_core._internal.pipeline`` through ``BucketedEngine``), driven in-process
  over ``ckpt_core.testing.in_process``: multi-bucket bit-exact transfer, per-bucket batches,
  statistics, and the failures a receiver and a sender must each see.
* Hook plugins from the ``ckpt_core.hooks`` entry-point group, from a real installed
  distribution, in a subprocess: a broken one warns by name, a good one observes a refit,
  ``CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD=1`` loads none.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_core
from ckpt_core._internal.send import KEEP_WHOLE_BYTES, MAX_CHUNKS_PER_BUCKET
from ckpt_core.chunking import split_weight_chunks_bounded
from ckpt_core.errors import IntegrityError, RemoteRefitError, UnsupportedTensorError, WireFormatError
from ckpt_core.hooks import plugin_manager
from ckpt_core.stats import RefitContext, RefitStats
from ckpt_core.testing.in_process import InProcessEngine, RefitOutcome, connected_pair, run_refit
from tests.helpers.distributions import Distribution, install, run_python
from tests.helpers.tensors import assert_same_weights, group_into_buckets, random_tensor

BUCKET = 64


class Recorder:
    """Records every hook call as ``(hook, role, refit_index, details)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def _add(self, hook: str, context: RefitContext, **details: Any) -> None:
        assert isinstance(context, RefitContext)
        assert (context.backend, context.rank) == ("memory", 0)
        with self._lock:
            self.calls.append((hook, context.role, context.refit_index, details))

    @ckpt_core.hookimpl
    def ckpt_core_refit_started(self, context: RefitContext) -> None:
        self._add("started", context)

    @ckpt_core.hookimpl
    def ckpt_core_bucket_sent(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
        self._add("bucket", context, index=bucket_index, nbytes=nbytes, chunks=num_chunks)

    @ckpt_core.hookimpl
    def ckpt_core_bucket_received(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
        self._add("bucket", context, index=bucket_index, nbytes=nbytes, chunks=num_chunks)

    @ckpt_core.hookimpl
    def ckpt_core_refit_finished(self, context: RefitContext, stats: RefitStats) -> None:
        self._add("finished", context, stats=stats)

    @ckpt_core.hookimpl
    def ckpt_core_refit_failed(self, context: RefitContext, error: BaseException) -> None:
        self._add("failed", context, error=error)

    def of(self, role: str, refit_index: int = 0) -> list[tuple[str, dict[str, Any]]]:
        return [(hook, details) for hook, r, i, details in self.calls if (r, i) == (role, refit_index)]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    recorder = Recorder()
    manager = plugin_manager()
    manager.register(recorder)
    try:
        yield recorder
    finally:
        manager.unregister(recorder)


def mixed_weights(rng: torch.Generator, scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Tensors that exercise the layout: spans, padding, empty, scalar, views, odd dtypes."""
    matrix = random_tensor((6, 10), torch.float32, rng)
    return [
        ("embed", random_tensor((40 * scale,), torch.bfloat16, rng)),  # spans buckets
        ("flag", random_tensor((3,), torch.bool, rng)),
        ("empty", random_tensor((0, 3), torch.float64, rng)),
        ("scale", random_tensor((), torch.float64, rng)),
        ("proj.T", matrix.t()),  # non-contiguous
        ("fp8", random_tensor((17,), torch.float8_e4m3fn, rng)),
        ("rot", random_tensor((5,), torch.complex64, rng)),
        ("huge", random_tensor((10 * BUCKET,), torch.uint8, rng)),  # 10x the bucket
        ("tail", random_tensor((1,), torch.int64, rng)),
    ]


def expected_buckets(weights: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Per bucket of the pipeline's layout: payload end, chunk count, tensors it completes."""
    layout = split_weight_chunks_bounded(
        (item for item in weights), BUCKET, max_chunks=MAX_CHUNKS_PER_BUCKET, keep_whole=KEEP_WHOLE_BYTES
    )
    buckets = group_into_buckets(layout)
    return [
        {
            "nbytes": max(m.offset + m.chunk_size for m, _ in b),  # type: ignore[operator]
            "chunks": len(b),
            "completes": [m.name for m, _ in b if m.chunk_offset + m.chunk_size == m.nbytes],
        }
        for b in buckets
    ]


def assert_clean(outcome: RefitOutcome) -> None:
    assert outcome.send_error is None, f"sender failed: {outcome.send_error!r}"
    assert outcome.receive_error is None, f"receiver failed: {outcome.receive_error!r}"


# --- a run-time hook observes real refits ----------------------------------------------------


def test_runtime_hook_observes_two_refits(recorder: Recorder, rng: torch.Generator) -> None:
    policy, rollout = connected_pair(BUCKET)
    try:
        refits = [mixed_weights(rng), mixed_weights(rng, scale=3)]
        for weights in refits:
            outcome = run_refit(policy, rollout, functools.partial(iter, weights))
            assert_clean(outcome)
            assert_same_weights(outcome.received, weights)
    finally:
        policy.finalize()
        rollout.finalize()

    for refit_index, weights in enumerate(refits):
        buckets = expected_buckets(weights)
        payload = sum(t.numel() * t.element_size() for _, t in weights)
        for role in ("policy", "rollout"):
            calls = recorder.of(role, refit_index)
            hooks = [hook for hook, _ in calls]
            assert hooks == ["started"] + ["bucket"] * len(buckets) + ["finished"], (role, hooks)
            seen = [details for hook, details in calls if hook == "bucket"]
            assert [d["index"] for d in seen] == list(range(len(buckets)))
            assert [(d["nbytes"], d["chunks"]) for d in seen] == [(b["nbytes"], b["chunks"]) for b in buckets]
            stats = calls[-1][1]["stats"]
            assert (stats.payload_bytes, stats.tensors, stats.buckets) == (payload, len(weights), len(buckets))
            assert stats.seconds > 0


def test_unregistered_hook_sees_nothing(rng: torch.Generator) -> None:
    recorder = Recorder()
    manager = plugin_manager()
    manager.register(recorder)
    manager.unregister(recorder)
    policy, rollout = connected_pair(BUCKET)
    try:
        assert_clean(run_refit(policy, rollout, lambda: iter(mixed_weights(rng))))
    finally:
        policy.finalize()
        rollout.finalize()
    assert recorder.calls == []


# --- the pipeline ----------------------------------------------------------------------------


@pytest.mark.parametrize("direct_chunks", [False, True], ids=["packed", "direct-chunks"])
def test_multi_bucket_refit_is_bit_exact_with_one_batch_per_bucket(direct_chunks: bool, rng: torch.Generator) -> None:
    weights = mixed_weights(rng, scale=5)
    buckets = expected_buckets(weights)
    assert len(buckets) > 15
    policy, rollout = connected_pair(BUCKET, direct_chunks=direct_chunks)
    try:
        outcome = run_refit(policy, rollout, lambda: iter(weights))
        assert_clean(outcome)
        assert_same_weights(outcome.received, weights)
        assert [[n for n, _ in b] for b in outcome.batches] == [b["completes"] for b in buckets if b["completes"]]
        assert policy.last_stats is not None and rollout.last_stats is not None
        assert policy.last_stats.buckets == rollout.last_stats.buckets == len(buckets)
        assert policy.last_stats.tensors == rollout.last_stats.tensors == len(weights)
        # Bucket k used slot k % 2 on both sides (the receiver checks the slot it is told).
        assert policy.link is not None
        assert [slot for slot, _ in policy.link.posted] == [k % 2 for k in range(len(buckets))]
        # With direct chunks on, large chunks (the 10x-bucket tensor's among them) skip packing.
        assert policy.sender is not None
        assert (policy.sender.direct_posts > 0) == direct_chunks
    finally:
        policy.finalize()
        rollout.finalize()


def test_direct_chunks_to_a_receiver_that_cannot_take_them_are_refused(rng: torch.Generator) -> None:
    """A sender moving direct chunks to a receiver without ``direct_chunks`` (a mixed-up
    deployment) fails the refit with a clear error instead of reading the wrong bytes."""
    policy = InProcessEngine(bucket_size=BUCKET, direct_chunks=True)
    rollout = InProcessEngine(bucket_size=BUCKET)
    metadata = [policy.prepare(), rollout.prepare()]
    policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    try:
        outcome = run_refit(policy, rollout, lambda: iter([("big", random_tensor((BUCKET,), torch.float32, rng))]))
        assert isinstance(outcome.receive_error, WireFormatError)
        assert "arrives as a direct chunk" in str(outcome.receive_error)
        assert outcome.batches == []
    finally:
        policy.finalize()
        rollout.finalize()


def test_received_tensors_survive_later_buckets(rng: torch.Generator) -> None:
    """Slot buffers are reused for every bucket: a tensor yielded early must not change later."""
    weights = [(f"w{i}", random_tensor((7,), torch.float32, rng)) for i in range(40)]
    policy, rollout = connected_pair(BUCKET)
    try:
        outcome = run_refit(policy, rollout, lambda: iter(weights))
        assert_clean(outcome)
        assert len(outcome.batches) > 10
        assert_same_weights(outcome.received, weights)
    finally:
        policy.finalize()
        rollout.finalize()


def test_empty_refit(recorder: Recorder) -> None:
    policy, rollout = connected_pair(BUCKET)
    try:
        outcome = run_refit(policy, rollout, lambda: iter([]))
        assert_clean(outcome)
        assert outcome.batches == []
        assert policy.last_stats is not None and policy.last_stats.buckets == 1
    finally:
        policy.finalize()
        rollout.finalize()
    assert [h for h, _ in recorder.of("rollout")] == ["started", "bucket", "finished"]


def test_flipped_byte_is_an_integrity_error(recorder: Recorder, rng: torch.Generator) -> None:
    weights = mixed_weights(rng)
    policy, rollout = connected_pair(BUCKET, checksum=True)
    try:
        assert policy.link is not None
        policy.link.corrupt[2] = 5  # bucket 2 arrives with byte 5 flipped
        outcome = run_refit(policy, rollout, lambda: iter(weights))
        assert isinstance(outcome.receive_error, IntegrityError), repr(outcome.receive_error)
        assert "bucket 2 of refit 0" in str(outcome.receive_error)
        # Only tensors completed in buckets 0 and 1 may have been yielded, all intact.
        good = [n for b in expected_buckets(weights)[:2] for n in b["completes"]]
        assert [n for n, _ in outcome.received] == good[: len(outcome.received)]
        assert_same_weights(outcome.received, weights[: len(outcome.received)])
    finally:
        policy.finalize()
        rollout.finalize()
    failed = [d["error"] for h, d in recorder.of("rollout") if h == "failed"]
    assert len(failed) == 1 and isinstance(failed[0], IntegrityError)
    assert not any(h == "finished" for h, _ in recorder.of("rollout"))


def test_checksums_off_moves_bytes_unverified(rng: torch.Generator) -> None:
    weights = mixed_weights(rng)
    policy, rollout = connected_pair(BUCKET, checksum=False)
    try:
        outcome = run_refit(policy, rollout, lambda: iter(weights))
        assert_clean(outcome)
        assert_same_weights(outcome.received, weights)
    finally:
        policy.finalize()
        rollout.finalize()


def test_sender_generator_error_reaches_the_receiver(recorder: Recorder, rng: torch.Generator) -> None:
    weights = mixed_weights(rng)

    def failing() -> Iterator[tuple[str, torch.Tensor]]:
        yield from weights[:4]
        raise RuntimeError("optimizer state went missing")

    policy, rollout = connected_pair(BUCKET)
    try:
        outcome = run_refit(policy, rollout, failing)
        assert isinstance(outcome.send_error, RuntimeError) and "optimizer state" in str(outcome.send_error)
        assert isinstance(outcome.receive_error, RemoteRefitError), repr(outcome.receive_error)
        assert "RuntimeError: optimizer state went missing" in str(outcome.receive_error)
    finally:
        policy.finalize()
        rollout.finalize()
    for role in ("policy", "rollout"):
        assert [h for h, _ in recorder.of(role)][-1] == "failed", role


def test_duplicate_names_fail_the_sender(rng: torch.Generator) -> None:
    weights = [("w", random_tensor((4,), torch.float32, rng)), ("v", random_tensor((2,), torch.int8, rng)),
               ("w", random_tensor((4,), torch.float32, rng))]  # fmt: skip
    policy, rollout = connected_pair(BUCKET)
    try:
        outcome = run_refit(policy, rollout, lambda: iter(weights))
        assert isinstance(outcome.send_error, UnsupportedTensorError), repr(outcome.send_error)
        assert "'w'" in str(outcome.send_error)
        assert isinstance(outcome.receive_error, RemoteRefitError), repr(outcome.receive_error)
        assert "'w' appears twice" in str(outcome.receive_error)
    finally:
        policy.finalize()
        rollout.finalize()


def test_unsupported_weight_fails_both_sides(rng: torch.Generator) -> None:
    weights: list[tuple[str, Any]] = [("ok", random_tensor((3,), torch.float32, rng)), ("bad", [1, 2, 3])]
    policy, rollout = connected_pair(BUCKET)
    try:
        outcome = run_refit(policy, rollout, lambda: iter(weights))
        assert isinstance(outcome.send_error, UnsupportedTensorError)
        assert isinstance(outcome.receive_error, RemoteRefitError) and "'bad'" in str(outcome.receive_error)
    finally:
        policy.finalize()
        rollout.finalize()


# --- entry-point hook plugins ----------------------------------------------------------------

GOOD_HOOKS = """
    import ckpt_core

    calls = []

    @ckpt_core.hookimpl
    def ckpt_core_refit_started(context):
        calls.append(["started", context.role, context.refit_index])

    @ckpt_core.hookimpl
    def ckpt_core_refit_finished(context, stats):
        calls.append(["finished", context.role, stats.tensors])
"""

BROKEN_HOOKS = """
    raise ImportError("ckpt_test_broken_hooks needs libmetrics_for_tests, which is not installed")
"""

MISSPELLED_HOOKS = """
    import ckpt_core

    @ckpt_core.hookimpl
    def ckpt_core_refit_finsihed(context, stats):
        raise AssertionError("a hook that does not exist must never be called")
"""

PROBE = """
    import json, os, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from ckpt_core.hooks import HookPluginWarning, hook_plugin_failures, plugin_manager
        manager = plugin_manager()
    plugin_warnings = [str(w.message) for w in caught if issubclass(w.category, HookPluginWarning)]
    loaded = sorted(name for name, plugin in manager.list_name_plugin() if name in ("good", "broken", "misspelled"))

    from ckpt_core.testing.in_process import connected_pair, run_refit
    policy, rollout = connected_pair(64)
    outcome = run_refit(policy, rollout, lambda: iter([("w", torch.ones(40)), ("b", torch.zeros(3))]))
    policy.finalize(); rollout.finalize()
    assert outcome.send_error is None and outcome.receive_error is None, outcome.__dict__

    import sys
    good = sys.modules.get("ckpt_test_good_hooks")
    print(json.dumps({
        "warnings": plugin_warnings,
        "failures": hook_plugin_failures(),
        "loaded": loaded,
        "calls": good.calls if good else None,
    }))
"""


@pytest.fixture(scope="module")
def hook_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = Distribution(
        name="ckpt-test-hooks",
        modules={
            "ckpt_test_good_hooks": GOOD_HOOKS,
            "ckpt_test_broken_hooks": BROKEN_HOOKS,
            "ckpt_test_misspelled_hooks": MISSPELLED_HOOKS,
        },
        entry_points={
            "ckpt_core.hooks": {
                "good": "ckpt_test_good_hooks",
                "broken": "ckpt_test_broken_hooks",
                "misspelled": "ckpt_test_misspelled_hooks",
            }
        },
    )
    return install([dist], tmp_path_factory.mktemp("hook-dist"))


def test_entry_point_hooks_load_and_a_broken_one_warns(hook_site: Path, import_root: Path, tmp_path: Path) -> None:
    result = run_python(PROBE, path=[hook_site, import_root], cwd=tmp_path)
    assert result["loaded"] == ["good"]
    assert len(result["warnings"]) == 2
    broken = next(w for w in result["warnings"] if "'broken'" in w)
    for fragment in ("ImportError", "libmetrics_for_tests", "ckpt-test-hooks", "ckpt_test_broken_hooks"):
        assert fragment in broken, f"{fragment!r} missing from {broken!r}"
    misspelled = next(w for w in result["warnings"] if "'misspelled'" in w)
    for fragment in ("HookValidationError", "'ckpt_core_refit_finsihed'", "did you mean 'ckpt_core_refit_finished'"):
        assert fragment in misspelled, f"{fragment!r} missing from {misspelled!r}"
    assert sorted(result["failures"]) == ["broken", "misspelled"]
    assert "libmetrics_for_tests" in result["failures"]["broken"]
    # The good plugin observed the refit on both sides; the broken one stopped nothing.
    assert sorted(map(tuple, result["calls"])) == sorted(
        [("started", "policy", 0), ("started", "rollout", 0), ("finished", "policy", 2), ("finished", "rollout", 2)]
    )


def test_disable_autoload_loads_no_hook_plugin(hook_site: Path, import_root: Path, tmp_path: Path) -> None:
    env = {"CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = run_python(PROBE, path=[hook_site, import_root], env=env, cwd=tmp_path)
    assert result == {"warnings": [], "failures": {}, "loaded": [], "calls": None}


def test_a_blocked_hook_plugin_is_not_loaded(hook_site: Path, import_root: Path, tmp_path: Path) -> None:
    env = {"CKPT_CORE_BLOCK_PLUGINS": " good , misspelled"}
    result = run_python(PROBE, path=[hook_site, import_root], env=env, cwd=tmp_path)
    assert result["loaded"] == [] and result["calls"] is None
    assert list(result["failures"]) == ["broken"]


class _Misspelled:
    @ckpt_core.hookimpl
    def ckpt_core_bucket_snet(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
        raise AssertionError("never called")


class _ExtraArgument:
    @ckpt_core.hookimpl
    def ckpt_core_refit_started(self, context: RefitContext, when: float) -> None:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("plugin", "match"),
    [
        (_Misspelled(), "'ckpt_core_bucket_snet' \\(did you mean 'ckpt_core_bucket_sent'\\?\\)"),
        (_ExtraArgument(), "'when'"),
    ],
    ids=["misspelled-hook", "unknown-argument"],
)
def test_register_refuses_a_hook_that_does_not_exist(plugin: object, match: str) -> None:
    from ckpt_core.errors import HookValidationError
    from ckpt_core.hooks import register

    before = len(plugin_manager().get_plugins())
    with pytest.raises(HookValidationError, match=match):
        register(plugin)
    assert len(plugin_manager().get_plugins()) == before
