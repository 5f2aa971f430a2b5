"""The measured methods, harness side: each owns one pool of worker processes, reused across
payloads and repetitions, and turns one measurement into a :class:`Sample`.

A method's life: ``open()`` (start processes, form groups) -> per payload ``warm_up()`` (one
untimed transfer that maps and touches everything and, where possible, checks every tensor
bit-exact) -> ``sample()`` repeatedly -> ``close()``. Any failure raises; the harness records it
as that case's error and stops using the method.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

from ckpt_core.orchestration.coordinator import CallResult, RefitCoordinator, RefitFailedError
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs

from .weights import Payload

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def worker_env() -> dict[str, str]:
    """The environment for worker processes: this one, with the repository root importable
    (workers load ``benchmarks.services``)."""
    env = dict(os.environ)
    paths = [_REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclasses.dataclass(frozen=True)
class WorkerSample:
    """One process's part of one measurement."""

    label: str
    role: str  # "sender", "receiver" or "local"
    rss_base_bytes: int
    rss_before_bytes: int
    rss_peak_bytes: int
    cpu_seconds: float
    stats: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measurement: end-to-end seconds (first sender start to last receiver end)."""

    seconds: float
    workers: tuple[WorkerSample, ...]
    phases: dict[str, float] | None = None
    """A refit with ``record_bucket_posts``: where its time went (see :func:`refit_phases`)."""


def _worker_sample(label: str, role: str, record: dict[str, Any]) -> WorkerSample:
    return WorkerSample(
        label=label,
        role=role,
        rss_base_bytes=int(record["rss_base_bytes"]),
        rss_before_bytes=int(record["rss_before_bytes"]),
        rss_peak_bytes=int(record["rss_peak_bytes"]),
        cpu_seconds=float(record["cpu_seconds"]),
        stats=record.get("stats"),
    )


def _checked(step: str, results: list[CallResult]) -> list[Any]:
    failed = [r for r in results if not r.ok]
    if failed:
        raise RefitFailedError(step, failed)
    return [r.value for r in results]


class Method(abc.ABC):
    """One way of moving a payload, measured by the harness."""

    key: str
    """Stable identifier, used in JSON and on the command line."""
    label: str
    """Human-readable name for tables and plots."""
    kind: str
    """``"refit"`` (ckpt-engine), ``"floor"`` (raw Gloo), ``"memory"`` (memcpy), ``"naive"``."""
    shape: str
    """``"1->1"``, ``"1->2"``, or ``"local"`` for the in-process copy."""
    bucket_size: int | None = None

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pool: LocalProcessPool | None = None

    def _start(
        self, specs: list[dict[str, Any]], labels: list[str], env: dict[str, str] | None = None
    ) -> LocalProcessPool:
        self.pool = LocalProcessPool(specs, labels=labels, env=env or worker_env(), start_timeout_s=self.timeout_s)
        return self.pool

    def _call(self, step: str, calls: list[tuple[int, str, dict[str, Any]]]) -> list[Any]:
        assert self.pool is not None, "open() first"
        return _checked(step, self.pool.call(calls, self.timeout_s))

    @abc.abstractmethod
    def open(self) -> None:
        """Start this method's processes."""

    def warm_up(self, payload: Payload) -> None:
        """One untimed transfer of ``payload``."""
        self.sample(payload)

    @abc.abstractmethod
    def sample(self, payload: Payload) -> Sample:
        """One timed transfer of ``payload``."""

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    receiver_holds_payload = True
    """Whether a receiving process keeps every tensor it got until the end (memory is then
    measured over the payload); a borrowing receiver keeps none."""

    def describe(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "kind": self.kind,
            "shape": self.shape,
            "bucket_size": self.bucket_size,
            "receiver_holds_payload": self.receiver_holds_payload,
        }


class RefitMethod(Method):
    """A ckpt-engine refit through ``backend``: one policy process, ``num_rollout`` rollouts."""

    kind = "refit"
    bucket_size: int  # every refit has one

    def __init__(
        self,
        *,
        key: str,
        label: str,
        backend: str,
        num_rollout: int,
        bucket_size: int,
        engine_kwargs: dict[str, Any],
        topology: str,
        timeout_s: float,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        self.key, self.label, self.backend = key, label, backend
        self.num_rollout = num_rollout
        self.shape = f"1->{num_rollout}"
        self.bucket_size = bucket_size
        self.engine_kwargs = {"timeout_s": max(1.0, timeout_s - 30.0), **engine_kwargs}
        # A borrowing rollout worker digests each batch as it arrives and keeps nothing.
        self.receiver_holds_payload = not self.engine_kwargs.get("borrow_received_tensors", False)
        self.topology = topology
        self.coordinator: RefitCoordinator | None = None
        self._set_up = False

    def open(self) -> None:
        specs, labels = refit_worker_specs(
            backend=self.backend,
            num_policy=1,
            num_rollout=self.num_rollout,
            bucket_size=self.bucket_size,
            engine_kwargs=self.engine_kwargs,
            weights="benchmarks.weights:small_tensors",  # replaced by every refit's payload
            weights_params={"count": 1, "nbytes": 4},
            verify=False,
        )
        for spec in specs:
            spec["service"] = "benchmarks.services:BenchRefitWorker"
        pool = self._start(specs, labels)
        self.coordinator = RefitCoordinator(
            pool, num_policy=1, num_rollout=self.num_rollout, timeout_s=self.timeout_s, topology=self.topology
        )
        self.coordinator.setup()
        self._set_up = True

    def _set_verify(self, enabled: bool) -> None:
        assert self.pool is not None
        self._call("set_verify", [(i, "set_verify", {"enabled": enabled}) for i in range(len(self.pool))])

    def warm_up(self, payload: Payload) -> None:
        """A refit with per-tensor digests: the coordinator checks every tensor bit-exact."""
        self._set_verify(True)
        try:
            report = self._refit(payload)
        finally:
            self._set_verify(False)
        for result in report.rollout:
            if result["tensors"] != payload.tensors:
                raise RuntimeError(
                    f"{self.label}: rollout rank {result['rank']} received {result['tensors']} tensors "
                    f"of {payload.label}, expected {payload.tensors}"
                )

    def _refit(self, payload: Payload) -> Any:
        assert self.coordinator is not None, "open() first"
        return self.coordinator.refit(weights=payload.weights, weights_params=payload.weights_params)

    def record_bucket_posts(self) -> None:
        """From now on, samples carry the sender's ``phases`` (see :func:`refit_phases`)."""
        assert self.pool is not None, "open() first"
        self._call("record_bucket_posts", [(0, "record_bucket_posts", {})])  # worker 0: the policy

    def sample(self, payload: Payload) -> Sample:
        report = self._refit(payload)
        sender = report.policy[0]
        ended_at = max(r["ended_at"] for r in report.rollout)
        seconds = ended_at - sender["started_at"]
        workers = [_worker_sample("policy rank 0", "sender", sender)]
        workers += [_worker_sample(f"rollout rank {r['rank']}", "receiver", r) for r in report.rollout]
        phases = refit_phases(sender, ended_at) if "bucket_posts" in sender else None
        return Sample(seconds, tuple(workers), phases)

    def close(self) -> None:
        coordinator, self.coordinator = self.coordinator, None
        set_up, self._set_up = self._set_up, False
        try:
            if coordinator is not None and set_up:
                coordinator.finalize()
        except RefitFailedError:
            pass  # the processes are closed next either way; the failure is already recorded
        finally:
            super().close()


def refit_phases(sender: dict[str, Any], ended_at: float) -> dict[str, float]:
    """Where a refit's time went, from its sender's bucket posts and statistics (seconds):

    * ``producing``: the sender making and packing its weights up to its last post (time in the
      weights' generator and copying into slots; without ``blocked``);
    * ``blocked``: the sender waiting on the transport before its last post (a slot still in
      flight), time it could not produce;
    * ``after_last_post``: from the last post until the last receiver holds every tensor (the
      bytes still on their way once everything is produced);
    * ``first_post``: from the start to the first post (part of ``producing``): nothing can
      move before the first bucket is made.

    ``producing + blocked + after_last_post`` is the refit's end-to-end time. A post is stamped
    when the transport's post call returned (the ``bucket_sent`` hook), which can be after the
    last receiver already holds every tensor (the sender's thread resumed late): a stamp is
    taken as ``ended_at`` at the latest, so no phase is negative.
    """
    posts = [min(post, ended_at) for post in sender["bucket_posts"]]
    waited_after_last_post = sender["ended_at"] - posts[-1]
    blocked = max(0.0, sender["stats"]["transfer_seconds"] - waited_after_last_post)
    return {
        "producing": posts[-1] - sender["started_at"] - blocked,
        "blocked": blocked,
        "after_last_post": ended_at - posts[-1],
        "first_post": posts[0] - sender["started_at"],
    }


class FloorMethod(Method):
    """Raw ``torch.distributed`` Gloo: the same bytes as one tensor (or in bucket-sized pieces)."""

    kind = "floor"

    def __init__(
        self,
        *,
        key: str,
        label: str,
        topology: str,
        num_receivers: int,
        timeout_s: float,
        piece_bytes: int | None = None,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        self.key, self.label, self.topology = key, label, topology
        self.num_receivers = num_receivers
        self.shape = f"1->{num_receivers}"
        self.piece_bytes = piece_bytes
        self.bucket_size = piece_bytes

    def open(self) -> None:
        size = self.num_receivers + 1
        specs = [
            {"service": "benchmarks.services:RawFloorWorker", "rank": r, "size": size, "timeout_s": self.timeout_s}
            for r in range(size)
        ]
        labels = ["raw sender"] + [f"raw receiver {r}" for r in range(1, size)]
        self._start(specs, labels)
        metadata = self._call("raw Gloo prepare", [(r, "prepare", {}) for r in range(size)])
        self._call("raw Gloo init", [(r, "init", {"metadata": metadata}) for r in range(size)])

    def sample(self, payload: Payload) -> Sample:
        kwargs = {"nbytes": payload.payload_bytes, "topology": self.topology, "piece_bytes": self.piece_bytes}
        records = self._call("raw Gloo transfer", [(r, "transfer_once", kwargs) for r in range(self.num_receivers + 1)])
        seconds = max(r["ended_at"] for r in records[1:]) - records[0]["started_at"]
        workers = [_worker_sample("raw sender", "sender", records[0])]
        workers += [_worker_sample(f"raw receiver {i}", "receiver", r) for i, r in enumerate(records[1:], 1)]
        return Sample(seconds, tuple(workers))


class BesideProducing(Method):
    """Another method's sample, taken while a process of its own produces weights over and over.

    It shows how fast that method moves bytes when producing takes its share of the machine
    (a core, and the memory bandwidth every core shares), as it does inside a refit of produced
    weights. The producer runs with ``threads`` (the refit's policy process's share); the
    sample is refused unless producing covered it from start to end.
    """

    def __init__(self, inner: Method, *, key: str, label: str, threads: int, produce_s: float = 1.0) -> None:
        super().__init__(timeout_s=inner.timeout_s)
        self.inner = inner
        self.key, self.label = key, label
        self.kind, self.shape, self.bucket_size = inner.kind, inner.shape, inner.bucket_size
        self.producer = ProduceMethod(
            key=f"{key}_producer", label="producer", timeout_s=inner.timeout_s, threads=threads
        )
        self.produce_s = produce_s
        """How long each producer call keeps producing: longer than the inner sample takes."""
        self.producing: Payload | None = None
        """The weights produced beside each sample (set before sampling)."""

    def open(self) -> None:
        self.producer.open()
        self.inner.open()

    def warm_up(self, payload: Payload) -> None:
        self.inner.warm_up(payload)

    def sample(self, payload: Payload) -> Sample:
        producing = self.producing
        assert producing is not None, "set producing first"
        records: list[dict[str, Any]] = []
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                records.append(self.producer.produce_for(producing, self.produce_s))
            except BaseException as exc:  # re-raised below, on the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=produce, name="beside-producing")
        thread.start()
        time.sleep(0.05)  # the producer's first tensors are under way before the sample starts
        before = time.perf_counter()
        try:
            sample = self.inner.sample(payload)
        finally:
            thread.join(self.timeout_s)
        after = time.perf_counter()
        if errors:
            raise errors[0]
        if thread.is_alive() or not records:
            raise RuntimeError(f"{self.label}: the producer did not answer within {self.timeout_s:g} s")
        (record,) = records
        if not record["started_at"] <= before and after <= record["ended_at"]:
            raise RuntimeError(
                f"{self.label}: producing ({record['started_at']:.3f}-{record['ended_at']:.3f}) did not cover "
                f"the sample ({before:.3f}-{after:.3f}); raise produce_s above {self.produce_s:g}"
            )
        return Sample(sample.seconds, (*sample.workers, _worker_sample("producer", "local", record)), sample.phases)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.producer.close()


class MemcpyMethod(Method):
    """Single-thread copies of the payload's bytes into warm memory: one process, or several
    at once (each copying the whole payload), which is the ceiling of a pipeline that copies
    every byte once per process, such as shared memory (the sender packs, each receiver copies
    out): on a machine whose cores share one memory bus, concurrent copies each run slower."""

    kind, shape = "memory", "local"

    def __init__(self, *, processes: int = 1, timeout_s: float) -> None:
        super().__init__(timeout_s=timeout_s)
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        if processes == 1:
            self.key, self.label = "memcpy", "memcpy, 1 thread (memory limit)"
        else:
            self.key, self.label = f"memcpy_{processes}proc", f"memcpy, {processes} processes at once"

    def open(self) -> None:
        labels = [f"memcpy worker {i}" for i in range(self.processes)]
        self._start([{"service": "benchmarks.services:MemcpyWorker"}] * self.processes, labels)

    def sample(self, payload: Payload) -> Sample:
        kwargs = {"weights": payload.weights, "weights_params": payload.weights_params}
        records = self._call("memcpy", [(i, "copy", kwargs) for i in range(self.processes)])
        for record in records:
            if record["payload_bytes"] != payload.payload_bytes:
                raise RuntimeError(f"memcpy copied {record['payload_bytes']} bytes, expected {payload.payload_bytes}")
        seconds = max(r["ended_at"] for r in records) - min(r["started_at"] for r in records)
        workers = tuple(_worker_sample(f"memcpy worker {i}", "local", r) for i, r in enumerate(records))
        return Sample(seconds, workers)


class NaiveMethod(Method):
    """Save the state dict to a file on tmpfs, then load it in ``num_receivers`` other
    processes at once; end-to-end from the first byte written to the last receiver's dict."""

    kind = "naive"

    def __init__(self, *, key: str, label: str, fmt: str, num_receivers: int, scratch: Path, timeout_s: float) -> None:
        super().__init__(timeout_s=timeout_s)
        self.key, self.label, self.fmt = key, label, fmt
        self.num_receivers = num_receivers
        self.shape = f"1->{num_receivers}"
        self.path = scratch / f"{key}.{'pt' if fmt == 'torch' else 'safetensors'}"

    def open(self) -> None:
        size = self.num_receivers + 1
        labels = ["saving process"] + [f"loading process {r}" for r in range(1, size)]
        self._start([{"service": "benchmarks.services:NaiveWorker", "fmt": self.fmt}] * size, labels)

    def sample(self, payload: Payload) -> Sample:
        try:
            (saved,) = self._call(
                "save",
                [
                    (
                        0,
                        "save",
                        {"weights": payload.weights, "weights_params": payload.weights_params, "path": str(self.path)},
                    )
                ],
            )
            loaded = self._call(
                "load", [(r, "load", {"path": str(self.path)}) for r in range(1, self.num_receivers + 1)]
            )
        finally:
            self.path.unlink(missing_ok=True)
        for record in loaded:
            if (record["tensors"], record["payload_bytes"]) != (payload.tensors, payload.payload_bytes):
                raise RuntimeError(
                    f"{self.label}: loaded {record['tensors']} tensors / {record['payload_bytes']} bytes, "
                    f"expected {payload.tensors} / {payload.payload_bytes}"
                )
        seconds = max(r["ended_at"] for r in loaded) - saved["started_at"]
        workers = [_worker_sample("saving process", "sender", saved)]
        workers += [_worker_sample(f"loading process {i}", "receiver", r) for i, r in enumerate(loaded, 1)]
        return Sample(seconds, tuple(workers))


def describe_error(exc: BaseException) -> str:
    """What failed, in one string (a ``RefitFailedError`` lists each worker's error)."""
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


class ProduceMethod(Method):
    """Producing the payload alone, in one process: what a refit of produced weights must hide."""

    kind = "produce"
    shape = "local"

    def __init__(self, *, key: str, label: str, timeout_s: float, threads: int | None = None) -> None:
        super().__init__(timeout_s=timeout_s)
        self.key, self.label = key, label
        self.threads = threads
        """torch's intra-op threads for producing (``None``: the pool's share, every core)."""
        self.layout: list[dict[str, Any]] = []

    def open(self) -> None:
        env = worker_env()
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self._start([{"service": "benchmarks.services:ProduceWorker"}], ["producer"], env)

    def sample(self, payload: Payload) -> Sample:
        (record,) = self._call(
            "produce", [(0, "produce", {"weights": payload.weights, "weights_params": payload.weights_params})]
        )
        self.layout = record.pop("layout")
        return Sample(record["ended_at"] - record["started_at"], (_worker_sample("producer", "local", record),))

    def produce_for(self, payload: Payload, seconds: float) -> dict[str, Any]:
        """Produce ``payload`` over and over for at least ``seconds``; the producer's record
        (``started_at`` and ``ended_at`` on the ``time.perf_counter()`` clock all workers share)."""
        kwargs = {"weights": payload.weights, "weights_params": payload.weights_params, "min_seconds": seconds}
        (record,) = self._call("produce", [(0, "produce", kwargs)])
        record.pop("layout")
        return dict(record)


class NaiveLoopMethod(Method):
    """Produce a tensor, ``dist.send`` it, repeat; the receiver allocates and ``recv``s each."""

    kind = "naive"
    shape = "1->1"

    def __init__(self, *, key: str, label: str, layout: ProduceMethod, timeout_s: float) -> None:
        super().__init__(timeout_s=timeout_s)
        self.key, self.label = key, label
        self._layout = layout  # the receiver's shapes and dtypes, from the producer's last run

    def open(self) -> None:
        specs = [
            {"service": "benchmarks.services:NaiveLoopWorker", "rank": r, "size": 2, "timeout_s": self.timeout_s}
            for r in range(2)
        ]
        self._start(specs, ["loop sender", "loop receiver"])
        metadata = self._call("naive loop prepare", [(r, "prepare", {}) for r in range(2)])
        self._call("naive loop init", [(r, "init", {"metadata": metadata}) for r in range(2)])

    def sample(self, payload: Payload) -> Sample:
        kwargs = {"weights": payload.weights, "weights_params": payload.weights_params, "layout": self._layout.layout}
        sender, receiver = self._call("naive loop", [(r, "loop", kwargs) for r in range(2)])
        if receiver["tensors"] != payload.tensors:
            raise RuntimeError(f"{self.label}: received {receiver['tensors']} tensors, expected {payload.tensors}")
        seconds = receiver["ended_at"] - sender["started_at"]
        workers = (
            _worker_sample("loop sender", "sender", sender),
            _worker_sample("loop receiver", "receiver", receiver),
        )
        return Sample(seconds, workers)
