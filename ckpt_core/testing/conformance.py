"""``TransportConformance``: the test classes a transport's own test suite inherits.

::

    from ckpt_core.testing import Shape, TransportConformance

    class TestMyTransport(TransportConformance):
        backend = "my_transport"              # its name in the ckpt_core.backends entry points
        engine_options = {"device": "cpu"}    # optional: engine_kwargs for every worker
        shapes = (Shape(1, 2), Shape(2, 1))   # optional: process counts (and topologies) to run

The tests cover the seed contract end to end: the registry finds the backend by name;
``prepare()`` metadata is plain JSON data; out-of-order calls raise (``LifecycleError`` on
engines built on ``BucketedEngine``) instead of hanging; refits between real processes are
bit-exact, in order, for one bucket and many, tensors larger than a bucket, every dtype,
zero-element and 0-d tensors, many tiny tensors, no tensors, and repeated refits with new
values; each policy rank runs its generator to the end exactly once, also a rank with no
receiver; ``finalize()`` then ``prepare()``/init again works; a rollout that borrows its
batches (``borrow_received_tensors``, where the engine takes it) receives them bit-exact; a
peer killed mid-refit fails the refit within the engine's ``timeout_s``.

Configuration is read from class attributes: ``backend``, ``engine_options``,
``bucket_size``, ``worker_env`` (checked into the class's ``conformance_settings`` fixture,
which a class may override), ``shapes``, ``dead_peer_shape``, ``peer_timeout_s``,
``peer_margin_s``, ``call_timeout_s``, ``lifecycle_deadline_s``, and the
:meth:`~TransportConformance.worker_engine_options` hook. Every fixture of the kit is defined
on this class and named ``conformance_*``, so nothing leaks into other tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import EngineOptionError, LifecycleError, TransferError
from ckpt_core.options import schema_of
from ckpt_core.orchestration.coordinator import RefitFailedError
from ckpt_core.registry import (
    backend_names,
    create_checkpoint_engine,
    list_backends,
    resolve_backend,
)
from ckpt_core.testing import plugin as kit_plugin
from ckpt_core.testing.cluster import ConformanceCluster, Shape, worker_environment
from ckpt_core.testing.lifecycle import OUT_OF_ORDER_CASES, OutOfOrderCase, run_out_of_order
from ckpt_core.testing.settings import DEFAULT_BUCKET_SIZE, KitSettings
from ckpt_core.transport.capabilities import declared_capabilities
from ckpt_core.transport.engine import BucketedEngine

CLUSTER_FIXTURE = "conformance_cluster"


def _transfer_error_names() -> set[str]:
    """Names of ``TransferError`` and every subclass imported so far (backends included)."""
    names, todo = set(), [TransferError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


class TransportConformance:
    """Inherit it in a ``Test*`` class and set ``backend``; see the module docstring."""

    backend: ClassVar[str]
    """Entry-point name of the backend under test (or ``"module:ClassName"``). Required."""
    engine_options: ClassVar[dict[str, Any]] = {}
    """Engine options (``engine_kwargs``) for every worker."""
    bucket_size: ClassVar[int] = DEFAULT_BUCKET_SIZE
    """Bytes per bucket. Kept small so that refits span many buckets."""
    worker_env: ClassVar[dict[str, str]] = {}
    """Extra environment for worker processes (``PYTHONPATH`` is prepended to the inherited)."""
    shapes: ClassVar[Sequence[Shape | tuple[Any, ...]]] = (Shape(1, 2), Shape(2, 1))
    """Process counts (and topologies) the refit tests run on, one worker pool each.
    Include one with a policy rank that has no receiver (``Shape(2, 1)`` for a broadcast)."""
    dead_peer_shape: ClassVar[Shape | tuple[Any, ...] | None] = None
    """Shape of the killed-peer test; default one policy and one rollout rank, with the
    first shape's topology."""
    peer_timeout_s: ClassVar[float] = 15.0
    """``timeout_s`` given to the engine in the killed-peer test (if it takes that option)."""
    peer_margin_s: ClassVar[float] = 30.0
    """How much later than ``peer_timeout_s`` the killed-peer refit may fail (slow machines)."""
    call_timeout_s: ClassVar[float] = 180.0
    """Deadline of every lifecycle step on the worker pools: past it a worker is killed and
    the test fails as hung."""
    lifecycle_deadline_s: ClassVar[float] = 30.0
    """Deadline of each in-process out-of-order call."""

    def worker_engine_options(self, options: dict[str, Any], *, role: str, rank: int, shape: Shape) -> dict[str, Any]:
        """Engine options of one worker; override to give each worker its own device."""
        return options

    # --- collection ------------------------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if not metafunc.config.pluginmanager.is_registered(kit_plugin):
            raise pytest.UsageError(
                "the ckpt-core conformance kit needs its pytest plugin: it loads automatically "
                "when ckpt-core is installed; with PYTEST_DISABLE_PLUGIN_AUTOLOAD set, pass "
                "-p ckpt_core.testing.plugin"
            )
        if CLUSTER_FIXTURE in metafunc.fixturenames:
            shapes = [Shape.coerce(s) for s in type(self).shapes]
            if not shapes:
                raise pytest.UsageError(f"{type(self).__name__}.shapes is empty: list at least one Shape")
            metafunc.parametrize(CLUSTER_FIXTURE, shapes, indirect=True, scope="class", ids=[s.id for s in shapes])

    # --- fixtures --------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_settings(cls) -> KitSettings:
        """The class's ``backend``, ``engine_options``, ``bucket_size`` and ``worker_env``,
        checked. Override this fixture (``scope="class"``) to compute them instead."""
        return KitSettings.of(cls)

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_cluster(
        cls, request: pytest.FixtureRequest, conformance_settings: KitSettings
    ) -> Iterator[ConformanceCluster]:
        """Worker processes of one shape, shared by the class's refit tests."""
        owner = cls()
        shape: Shape = request.param
        settings = conformance_settings
        cluster = ConformanceCluster(
            backend=settings.backend,
            shape=shape,
            bucket_size=settings.bucket_size,
            engine_options=dict(settings.engine_options),
            worker_options=lambda options, role, rank: owner.worker_engine_options(
                options, role=role, rank=rank, shape=shape
            ),
            env=worker_environment(dict(settings.worker_env)),
            call_timeout_s=owner.call_timeout_s,
        )
        try:
            yield cluster
        finally:
            cluster.close()

    @pytest.fixture
    def refit_cluster(self, conformance_cluster: ConformanceCluster) -> ConformanceCluster:
        """The shared cluster, set up for this test."""
        conformance_cluster.ensure_ready()
        return conformance_cluster

    def _cluster_of_its_own(
        self,
        settings: KitSettings,
        shape: Shape,
        options: dict[str, Any],
        call_timeout_s: float,
        *,
        blocking: bool = False,
    ) -> ConformanceCluster:
        """Worker processes for one test that needs other engine options than the class's
        (``blocking``: workers that use the blocking calls)."""
        return ConformanceCluster(
            blocking=blocking,
            backend=settings.backend,
            shape=shape,
            bucket_size=settings.bucket_size,
            engine_options=options,
            worker_options=lambda o, role, rank: self.worker_engine_options(o, role=role, rank=rank, shape=shape),
            env=worker_environment(dict(settings.worker_env)),
            call_timeout_s=call_timeout_s,
        )

    def _takes_option(self, settings: KitSettings, option: str) -> bool:
        """Whether the backend's options schema declares ``option`` (an engine without a schema
        is given no option the class did not configure)."""
        schema = schema_of(resolve_backend(settings.backend))
        return schema is not None and option in schema.names()

    def _engine(self, settings: KitSettings, extra: dict[str, Any] | None = None) -> CheckpointEngine:
        options = {**settings.engine_options, **(extra or {})}
        options = self.worker_engine_options(options, role="policy", rank=0, shape=Shape(1, 1))
        return create_checkpoint_engine(settings.backend, bucket_size_bytes=settings.bucket_size, engine_kwargs=options)

    # --- registry ----------------------------------------------------------------------------

    def test_registry_finds_backend_by_name(self, conformance_settings: KitSettings) -> None:
        backend = conformance_settings.backend
        if ":" in backend:
            pytest.skip(
                f"{backend!r} names a class directly; register an entry point in "
                "'ckpt_core.backends' to test discovery by name"
            )
        engine_class = resolve_backend(backend)
        assert backend in backend_names()
        infos = [info for info in list_backends() if info.name == backend]
        assert len(infos) == 1, f"{backend!r} is registered {len(infos)} times: {infos}"
        assert infos[0].loads, f"list_backends() reports {backend!r} as not loading: {infos[0].error}"
        if issubclass(engine_class, BucketedEngine):
            assert engine_class.backend_name == backend, (
                f"{engine_class.__name__}.backend_name is {engine_class.backend_name!r}; set it to the "
                f"entry-point name {backend!r} (it is stamped into prepare() metadata)"
            )
        engine = self._engine(conformance_settings)
        try:
            assert type(engine) is engine_class
        finally:
            engine.finalize()

    # --- one engine, in this process ---------------------------------------------------------

    def test_prepare_metadata_is_plain_json(self, conformance_settings: KitSettings) -> None:
        engine = self._engine(conformance_settings)
        try:
            metadata = engine.prepare()
            try:
                text = json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise AssertionError(f"prepare() returned metadata that is not plain JSON data: {exc}") from exc
            assert json.loads(text) == metadata, (
                f"prepare() metadata changes in a JSON round trip (tuples, non-string keys, ...): "
                f"{metadata!r} -> {json.loads(text)!r}"
            )
        finally:
            engine.finalize()

    def test_takes_the_options_nemo_rl_passes(self, conformance_settings: KitSettings) -> None:
        """NeMo RL builds every plugin engine with ``release_after_refit`` (and may pass
        ``shard_expert_weights``); an engine that refuses them cannot be used from NeMo RL.
        ``BucketedEngine``'s options schema declares both: extend it, never restate or drop them."""
        for flag in (False, True):
            engine = self._engine(conformance_settings, {"release_after_refit": flag, "shard_expert_weights": flag})
            try:
                assert engine.shard_expert_weights is flag
            finally:
                engine.finalize()

    def test_options_are_declared_in_one_schema(self, conformance_settings: KitSettings) -> None:
        """Options are declared once, in the engine class's ``options`` schema, which the
        registry, ``ckpt-engine list``, the Ray launcher and this kit read: every default parses,
        an unknown name is refused naming the accepted ones, a value outside an option's choices
        is an ``EngineOptionError`` naming the option (checked before any availability probe),
        the class docstring lists every option, and declared topologies are the ``topology``
        option's choices."""
        settings = conformance_settings
        engine_class = resolve_backend(settings.backend)
        schema = schema_of(engine_class)
        if schema is None:
            pytest.skip(f"{engine_class.__name__} declares no options schema (a plain CheckpointEngine)")
        owner = engine_class.__name__
        for name, option in schema.items():
            if not option.required:
                option.check(owner, option.default)  # a default its own check refuses is a bug
            assert f"``{name}``" in (engine_class.__doc__ or ""), f"{owner}'s docstring does not list {name!r}"

        def create(extra: dict[str, Any]) -> CheckpointEngine:
            options = {**settings.engine_options, **extra}
            size = settings.bucket_size
            return create_checkpoint_engine(settings.backend, bucket_size_bytes=size, engine_kwargs=options)

        with pytest.raises(EngineOptionError, match="no option 'zz_unknown'.*Accepted options"):
            create({"zz_unknown": 1})
        for name, option in schema.items():
            if option.choices:
                with pytest.raises(EngineOptionError, match=name):
                    create({name: "zz-not-a-choice"})
        capabilities = declared_capabilities(engine_class)
        if capabilities is not None and "topology" in schema:
            assert set(capabilities.topologies) == set(schema["topology"].choices), (
                f"{owner}.capabilities.topologies {capabilities.topologies} differ from its topology "
                f"option's choices {schema['topology'].choices}"
            )

    def test_finalize_is_idempotent(self, conformance_settings: KitSettings) -> None:
        engine = self._engine(conformance_settings)
        engine.finalize()
        engine.prepare()
        engine.finalize()
        engine.finalize()
        engine.prepare()  # usable again after finalize()
        engine.finalize()

    @pytest.mark.parametrize("case", OUT_OF_ORDER_CASES, ids=[c.name for c in OUT_OF_ORDER_CASES])
    def test_out_of_order_call_raises(self, case: OutOfOrderCase, conformance_settings: KitSettings) -> None:
        engine = self._engine(conformance_settings)
        error = run_out_of_order(engine, case, self.lifecycle_deadline_s)
        if isinstance(engine, BucketedEngine):
            assert isinstance(error, LifecycleError), (
                f"{' -> '.join(case.steps)} raised {type(error).__name__}: {error}; engines built on "
                "BucketedEngine must raise LifecycleError (do not bypass its state checks)"
            )
        assert str(error), f"{' -> '.join(case.steps)} raised {type(error).__name__} without a message"

    # --- refits between processes ----------------------------------------------------------

    def test_single_bucket_refit(self, refit_cluster: ConformanceCluster) -> None:
        b = refit_cluster.bucket_size
        refit_cluster.refit("sized", {"sizes": [b // 8, b // 4, 100], "seed": 1})

    def test_multi_bucket_refit(self, refit_cluster: ConformanceCluster) -> None:
        b = refit_cluster.bucket_size
        report = refit_cluster.refit("sized", {"sizes": [b // 3] * 10, "seed": 2})
        assert report.rollout[0]["tensors"] == 10

    def test_tensor_larger_than_bucket(self, refit_cluster: ConformanceCluster) -> None:
        b = refit_cluster.bucket_size
        refit_cluster.refit("sized", {"sizes": [3 * b + 4, 16, 2 * b + 1, 8], "seed": 3})

    def test_every_dtype(self, refit_cluster: ConformanceCluster) -> None:
        refit_cluster.refit("every_dtype", {"elements": refit_cluster.bucket_size // 8 + 1, "seed": 4})

    def test_zero_element_and_scalar_tensors(self, refit_cluster: ConformanceCluster) -> None:
        refit_cluster.refit("empty_and_scalar", {"bucket_size": refit_cluster.bucket_size, "seed": 5})

    def test_many_tiny_tensors(self, refit_cluster: ConformanceCluster) -> None:
        report = refit_cluster.refit("tiny", {"count": 1000, "nbytes": 6, "seed": 6})
        assert report.rollout[0]["tensors"] == 1000

    def test_refit_of_no_tensors(self, refit_cluster: ConformanceCluster) -> None:
        report = refit_cluster.refit("nothing", {})
        assert all(r["tensors"] == 0 for r in report.rollout)

    def test_repeated_refits_with_changed_values(self, refit_cluster: ConformanceCluster) -> None:
        b = refit_cluster.bucket_size
        params = {"sizes": [b // 2, 2 * b, 40], "seed": 7}
        previous: dict[str, str] | None = None
        for _ in range(3):
            received = refit_cluster.refit("sized", params).rollout[0]["digests"]
            if previous is not None:
                assert all(received[name] != previous[name] for name in received), (
                    "a refit delivered the previous refit's values: every tensor changed at the source"
                )
            previous = received

    def test_refits_that_repeat_or_change_their_packing_are_bit_exact(self, refit_cluster: ConformanceCluster) -> None:
        """Refits of the same tensors (which the shared pipeline replays), then ones that add
        tensors, drop them and change their shapes midway: each verified tensor by tensor."""
        for count, nbytes, seed in (
            (600, 24, 13),
            (600, 24, 14),
            (650, 24, 15),
            (600, 40, 16),
            (300, 24, 17),
            (600, 24, 18),
        ):
            report = refit_cluster.refit("tiny", {"count": count, "nbytes": nbytes, "seed": seed})
            assert report.rollout[0]["tensors"] == count

    def test_rank_dependent_values_reach_their_rollouts(self, refit_cluster: ConformanceCluster) -> None:
        refit_cluster.refit("rank_dependent", {"count": 3, "elements": refit_cluster.bucket_size // 8, "seed": 8})

    def test_every_policy_rank_drains_its_generator_once(self, refit_cluster: ConformanceCluster) -> None:
        report = refit_cluster.refit("sized", {"sizes": [refit_cluster.bucket_size // 5] * 12, "seed": 9})
        for rank, result in enumerate(report.policy):
            assert result["consumption"] == {"pulled": 12, "exhausted": True, "expected": 12}, f"policy rank {rank}"

    def test_calls_after_finalize_raise(self, refit_cluster: ConformanceCluster) -> None:
        refit_cluster.finalize()
        pool_size = refit_cluster.shape.num_policy + refit_cluster.shape.num_rollout
        weights = {"weights": "ckpt_core.testing.weights:sized", "weights_params": {"sizes": [64]}}
        calls = [
            (i, "refit", {"refit_index": 0, **(weights if i < refit_cluster.shape.num_policy else {})})
            for i in range(pool_size)
        ]
        results = refit_cluster.call(calls, timeout_s=self.lifecycle_deadline_s)
        bucketed = issubclass(resolve_backend(refit_cluster.backend), BucketedEngine)
        for result in results:
            assert not result.ok, f"{result.worker}: a refit after finalize() succeeded; it must raise"
            assert "did not answer" not in (result.message or ""), f"{result.worker} hung: {result.message}"
            if bucketed:
                assert result.error_type == LifecycleError.__name__, result.describe()

    def test_reinit_after_finalize_refits_bit_exact(self, refit_cluster: ConformanceCluster) -> None:
        b = refit_cluster.bucket_size
        refit_cluster.refit("sized", {"sizes": [b + 3, b // 2], "seed": 10})
        for _ in range(2):
            refit_cluster.finalize()
            refit_cluster.setup()  # prepare() and init again, on the same engine objects
            refit_cluster.refit("sized", {"sizes": [b + 3, b // 2, 5], "seed": 11})
            refit_cluster.refit("every_dtype", {"seed": 12})

    def test_borrowed_receive_is_bit_exact(self, conformance_settings: KitSettings) -> None:
        """With ``borrow_received_tensors=True`` (engines that take it: every ``BucketedEngine``)
        a rollout's batches are views of the transport's buffers, valid until it asks for the
        next batch: the rollout worker digests each batch on arrival, so each lent view is
        checked before its buffer may be reused. Tiny tensors (lent a run at a time), tensors
        larger than a bucket (assembled) and every dtype, refit after refit."""
        backend = conformance_settings.backend
        if not self._takes_option(conformance_settings, "borrow_received_tensors"):
            pytest.skip(f"{backend} takes no borrow_received_tensors option")
        options = {**conformance_settings.engine_options, "borrow_received_tensors": True}
        shape = Shape(1, 1, Shape.coerce(type(self).shapes[0]).topology)
        cluster = self._cluster_of_its_own(conformance_settings, shape, options, self.call_timeout_s)
        b = conformance_settings.bucket_size
        with cluster:
            cluster.ensure_ready()
            for seed in (20, 21):  # the second refit replays the first's packing
                report = cluster.refit("tiny", {"count": 600, "nbytes": 24, "seed": seed})
                assert report.rollout[0]["tensors"] == 600
                cluster.refit("sized", {"sizes": [b // 3, 2 * b + 4, 40, b // 2], "seed": seed})
            cluster.refit("every_dtype", {"elements": b // 8 + 1, "seed": 22})

    def test_blocking_calls_refit_bit_exact(self, conformance_settings: KitSettings) -> None:
        """``send_weights_blocking`` and ``receive_weight_batches_blocking`` (the contract's
        calls for callers that block; ``BucketedEngine`` runs them on the calling thread, with
        no event loop there): bit-exact, in order, the policy's generator drained once, refit
        after refit (the second replays the first's packing), several buckets and a tensor
        larger than one."""
        shape = Shape.coerce(type(self).shapes[0])
        options = dict(conformance_settings.engine_options)
        cluster = self._cluster_of_its_own(conformance_settings, shape, options, self.call_timeout_s, blocking=True)
        b = conformance_settings.bucket_size
        with cluster:
            cluster.ensure_ready()
            for seed in (30, 31):
                report = cluster.refit("tiny", {"count": 600, "nbytes": 24, "seed": seed})
                assert all(r["tensors"] == 600 for r in report.rollout)
                cluster.refit("sized", {"sizes": [b // 3, 2 * b + 4, 40, b // 2], "seed": seed})

    # --- failures ------------------------------------------------------------------------------

    def test_killed_peer_fails_refit_within_timeout(self, conformance_settings: KitSettings, tmp_path: Path) -> None:
        bucket_size = conformance_settings.bucket_size
        shapes = [Shape.coerce(s) for s in type(self).shapes]
        shape = Shape.coerce(self.dead_peer_shape) if self.dead_peer_shape else Shape(1, 1, shapes[0].topology)
        options = dict(conformance_settings.engine_options)
        timeout_s = float(options.get("timeout_s", self.peer_timeout_s))
        if "timeout_s" not in options and self._takes_option(conformance_settings, "timeout_s"):
            options["timeout_s"] = timeout_s  # else the engine has no such option: its own deadline must hold
        limit_s = timeout_s + self.peer_margin_s
        cluster = self._cluster_of_its_own(
            conformance_settings, shape, options, max(self.call_timeout_s, limit_s + 30.0)
        )
        with cluster:
            cluster.ensure_ready()
            marker = tmp_path / "refit-in-flight"
            params = {"count": 500, "nbytes": bucket_size, "delay_s": 0.02, "marker": str(marker), "mark_after": 2}
            outcome: dict[str, BaseException | None] = {}

            def run_refit() -> None:
                try:
                    cluster.refit("slow_marked", params)
                    outcome["error"] = None
                except BaseException as exc:  # noqa: BLE001 - inspected below
                    outcome["error"] = exc

            thread = threading.Thread(target=run_refit, daemon=True)
            thread.start()
            deadline = time.monotonic() + self.call_timeout_s
            while not marker.exists():
                if not thread.is_alive():
                    raise AssertionError(f"the refit ended before the peer could be killed: {outcome.get('error')!r}")
                assert time.monotonic() < deadline, "the refit never got under way"
                time.sleep(0.01)
            killed_at = time.monotonic()
            cluster.pool.kill(cluster.rollout_index(0))
            thread.join(cluster.call_timeout_s + 30.0)
            elapsed = time.monotonic() - killed_at
        assert not thread.is_alive(), "the refit did not return after its peer was killed"
        error = outcome.get("error")
        assert isinstance(error, RefitFailedError), (
            f"killing rollout rank 0 mid-refit must fail the refit, got {error!r}"
        )
        failures = {f.worker: f for f in error.failures}
        policy = failures.get("policy rank 0")
        assert policy is not None, f"policy rank 0 finished its refit although its receiver was killed: {error}"
        hung = [f.describe() for f in error.failures if "did not answer" in (f.message or "")]
        assert not hung, "workers hung after a peer was killed:\n" + "\n".join(hung)
        names = _transfer_error_names()
        assert policy.error_type in names, (
            f"policy rank 0 failed with {policy.error_type}: {policy.message}; a lost peer must raise "
            f"PeerLostError or TransferTimeoutError (a ckpt_core.errors.TransferError)"
        )
        assert policy.message, "the policy's error must say what failed"
        assert elapsed < limit_s, (
            f"the refit failed {elapsed:.1f}s after the peer was killed; the engine's timeout_s is "
            f"{timeout_s:g}s (allowed: {limit_s:g}s)"
        )
