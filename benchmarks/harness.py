"""The schedule: phases of methods measured round-robin, so drift hits every method alike.

A phase is a list of methods and a list of payloads. For each payload, every method gets one
warm-up, then ``reps`` rounds in which every method is measured once, in the same order. A
method that fails is recorded (its error lands in each of its cases of the phase) and skipped
from then on; the run goes on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .methods import Method, Sample, describe_error
from .weights import Payload

Log = Callable[[str], None]
_OPENING_THREADS = 4


def stderr_log(start: float) -> Log:
    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:6.0f}s] {message}", file=sys.stderr, flush=True)

    return log


@dataclasses.dataclass
class CaseRecord:
    """Every sample of one (phase, method, payload)."""

    group: str
    method: dict[str, Any]
    payload: Payload
    samples: list[Sample] = dataclasses.field(default_factory=list)
    error: str | None = None


@dataclasses.dataclass
class Phase:
    group: str
    """Which measurements belong together, e.g. ``"bucket 64 MiB"``: ratios are taken within it."""
    methods: Sequence[Method]
    payloads: Sequence[Payload]
    reps: int


def run_phase(phase: Phase, log: Log) -> list[CaseRecord]:
    """Open the phase's methods that are not open yet, then measure; never raises for a
    method's failure. The caller closes the methods (some outlive a phase)."""
    records = {
        (m.key, p.label): CaseRecord(phase.group, m.describe(), p) for m in phase.methods for p in phase.payloads
    }
    to_open = [m for m in phase.methods if m.pool is None]
    failed: set[str] = set()
    # Starting processes (interpreter, torch import, rendezvous) dominates a phase's set-up;
    # a few pools start at once, the rest of the work waits on pipes.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_OPENING_THREADS) as executor:
        futures = {method.key: executor.submit(_open, method, phase.group, log) for method in to_open}
        for method in to_open:
            error = futures[method.key].result()
            if error is not None:
                _fail(records, method, phase.payloads, error, log, phase.group)
                failed.add(method.key)
    alive = [m for m in phase.methods if m.key not in failed]

    for payload in phase.payloads:
        for method in list(alive):
            try:
                method.warm_up(payload)
            except Exception as exc:  # noqa: BLE001
                _drop(alive, records, method, payload, phase, exc, log)
        for rep in range(1, phase.reps + 1):
            for method in list(alive):
                try:
                    sample = method.sample(payload)
                except Exception as exc:  # noqa: BLE001
                    _drop(alive, records, method, payload, phase, exc, log)
                    continue
                records[method.key, payload.label].samples.append(sample)
                gbps = payload.payload_bytes / sample.seconds / 1e9 if sample.seconds > 0 else 0.0
                log(
                    f"{phase.group}, {payload.label}, rep {rep}/{phase.reps}: {method.label} {method.shape}: "
                    f"{sample.seconds:.3f}s, {gbps:.2f} GB/s"
                )
    return list(records.values())


def _open(method: Method, group: str, log: Log) -> str | None:
    """Open ``method``; its error as text (after closing it), or ``None``."""
    began = time.monotonic()
    try:
        method.open()
    except Exception as exc:  # noqa: BLE001 - a broken backend is a result, not a crash
        method.close()
        return describe_error(exc)
    log(f"{group}: started {method.label} {method.shape} in {time.monotonic() - began:.1f}s")
    return None


def _drop(
    alive: list[Method],
    records: dict[tuple[str, str], CaseRecord],
    method: Method,
    payload: Payload,
    phase: Phase,
    exc: BaseException,
    log: Log,
) -> None:
    remaining = list(phase.payloads)[list(phase.payloads).index(payload) :]
    _fail(records, method, remaining, describe_error(exc), log, phase.group)
    alive.remove(method)
    method.close()


def _fail(
    records: dict[tuple[str, str], CaseRecord],
    method: Method,
    payloads: Sequence[Payload],
    error: str,
    log: Log,
    group: str,
) -> None:
    log(f"{group}: {method.label} FAILED: {error.splitlines()[0] if error else ''}")
    for payload in payloads:
        record = records[method.key, payload.label]
        if record.error is None:
            record.error = error
