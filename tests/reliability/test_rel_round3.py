"""Round three (issue #31): the scenarios that loaded wrong weights or crashed, now each either
served bit-exact or refused with a typed error, and the faults whose errors were untyped.

Single errors are rows of the bad-input table (``rel_bad_inputs``); these tests need more
than one refit, other processes, or a look at what a stranger can do:

* the weights generator's contract: a refit that repeats the last one's packing (a replay) reads
  every weight no later than the first refit did, so the two accept the same generators;
* a killed rollout in the ``paired`` and ``fanout`` topologies is a ``PeerLostError`` on the
  policy, as it was only in ``broadcast``;
* cuda_ipc's shared slots (``device="cpu"``) cannot be written by another process once set up.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_core.orchestration.coordinator import RefitFailedError
from ckpt_core.transport import BucketedEngine
from tests.reliability.rel_bad_inputs import frees_previous, refills_one_buffer
from tests.reliability.rel_faults import Striker, failures_by_worker
from tests.reliability.rel_inprocess import Pair
from tests.reliability.rel_team import Team

SMALL = 64  # elements: small tensors, packed (copied) into buckets, replayed in spans when safe
COUNT = 40
REFITS = 4


EXPECTED = [torch.full((SMALL,), float(i)) for i in range(COUNT)]


def fresh(count: int, elements: int) -> Iterator[tuple[str, torch.Tensor]]:
    return ((f"w{i}", torch.full((elements,), float(i))) for i in range(count))


GENERATORS: dict[str, Callable[[], Iterator[tuple[str, torch.Tensor]]]] = {
    "frees-each-after-the-next": lambda: frees_previous(COUNT, SMALL),
    "refills-one-buffer": lambda: refills_one_buffer(COUNT, SMALL),
    "fresh-tensors": lambda: fresh(COUNT, SMALL),
}
BACKENDS = {"gloo_cpu": {}, "cuda_ipc": {"device": "cpu"}}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("generator", sorted(GENERATORS))
def test_replays_serve_every_generator_the_first_refit_served(backend: str, generator: str) -> None:
    """Refit 0 lays the weights out, refits 1.. replay it; every one is bit-exact and the
    replays really replay. Before: a generator refilling one buffer got 29 of 30 tensors wrong
    from refit 1 on (both sides reporting success), and one freeing each weight once the next
    was asked for failed every refit after the first."""
    pair = Pair(backend, bucket_size=1 << 20, engine_kwargs=BACKENDS[backend])
    try:
        for outcome in pair.init_outcomes:
            outcome.get()
        for refit in range(REFITS):
            sent, received = pair.refit(GENERATORS[generator])
            sent.get()
            got = received.get()
            assert [name for name, _ in got] == [f"w{i}" for i in range(COUNT)]
            wrong = [name for (name, tensor), want in zip(got, EXPECTED) if not torch.equal(tensor, want)]
            assert not wrong, f"refit {refit}: {len(wrong)} of {COUNT} tensors wrong, first {wrong[0]}"
            assert isinstance(pair.policy, BucketedEngine)
            stats = pair.policy.last_stats
            assert stats is not None and stats.replayed_tensors == (COUNT if refit else 0), stats
    finally:
        pair.finalize()


def test_small_tensors_are_replayed_in_spans_only_where_the_first_refit_allows() -> None:
    """The fast path stays where it is safe: fresh tensors get spans, a generator that refills
    or frees its weights gets none (it is replayed one tensor at a time)."""
    spans = {}
    for generator in ("fresh-tensors", "refills-one-buffer", "frees-each-after-the-next"):
        pair = Pair("gloo_cpu", bucket_size=1 << 20)
        try:
            for outcome in pair.init_outcomes:
                outcome.get()
            sent, received = pair.refit(GENERATORS[generator])
            sent.get()
            received.get()
            record = pair.policy._packing_record  # type: ignore[attr-defined]  # the sender's record
            spans[generator] = sum(len(bucket.spans) for bucket in record.buckets)
        finally:
            pair.finalize()
    assert spans["fresh-tensors"] > 0, spans
    assert spans["refills-one-buffer"] == spans["frees-each-after-the-next"] == 0, spans


# --- a killed rollout in every topology ------------------------------------------------------

BUCKET = 64 << 10
TIMEOUT_S = 10.0
MARGIN_S = 20.0
P, R0, R1 = 0, 1, 2
SLOW = {"count": 60, "nbytes": 24 << 10, "delay_s": 0.05, "mark_after": 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("topology", "rollouts", "victim"),
    [pytest.param("paired", [R0], R0, id="paired"), pytest.param("fanout", [R0, R1], R1, id="fanout")],
)
def test_killed_rollout_is_a_typed_error_on_the_policy(
    team: Team, topology: str, rollouts: list[int], victim: int, tmp_path: Path
) -> None:
    """Before: the policy's send raised Gloo's own ``RuntimeError`` ("Connection closed by
    peer", "Read error") in these topologies, which post each message to one peer."""
    coordinator = team.coordinator(
        policy=[P],
        rollout=rollouts,
        backend="gloo_cpu",
        bucket_size=BUCKET,
        engine_kwargs={"topology": topology, "timeout_s": TIMEOUT_S},
        topology=topology,
    )
    try:
        coordinator.setup()
        coordinator.refit()
        params: dict[str, Any] = {**SLOW, "marker": str(tmp_path / "in-flight")}
        striker = Striker(team, victim, tmp_path / "in-flight")
        with pytest.raises(RefitFailedError) as caught:
            coordinator.refit(weights="tests.reliability.rel_weights:marked", weights_params=params)
        elapsed = striker.seconds_since_strike()
        assert elapsed < TIMEOUT_S + MARGIN_S, f"the refit took {elapsed:.1f}s to fail after the kill: a hang"
        policy = failures_by_worker(caught.value)["policy rank 0"]
        assert policy.error_type in ("PeerLostError", "TransferTimeoutError"), policy.describe()
        assert "rollout rank" in (policy.message or ""), policy.describe()
    finally:
        with contextlib.suppress(RefitFailedError):  # the killed worker cannot finalize
            coordinator.finalize()
        team.replace([victim])


# --- cuda_ipc's shared slots -----------------------------------------------------------------

STRANGER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
results = []
try:
    os.pwrite(fd, b"XXXX", 0)
    results.append("write allowed")
except OSError as exc:
    results.append(f"write refused: {exc.strerror}")
try:
    mapped = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mapped[:4] = b"YYYY"
    results.append("writable mapping allowed")
except OSError as exc:
    results.append(f"writable mapping refused: {exc.strerror}")
print("; ".join(results))
"""


def test_ipc_host_slots_cannot_be_written_by_another_process() -> None:
    """A same-user process reopening the policy's slot file through ``/proc/<pid>/fd`` (which
    ignores the descriptor's own mode) could write the slots during a refit, and every side
    reported success. The file is sealed once the policy mapped it: only that mapping writes."""
    from ckpt_cuda_ipc.buffers import HostSlots

    slots = HostSlots.allocate(1 << 16, 2)
    try:
        slots.view(0)[:4] = 7  # the policy's own mapping still writes
        path = f"/proc/{os.getpid()}/fd/{slots._fd}"
        result = subprocess.run([sys.executable, "-c", STRANGER, path], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (
            "write refused: Operation not permitted; writable mapping refused: Operation not permitted"
        ), result.stdout
        assert slots.view(0)[:4].tolist() == [7, 7, 7, 7]
    finally:
        slots.close()
