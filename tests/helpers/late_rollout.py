"""One side of a gloo_cpu refit whose rollout reaches its receive only after the policy's send
has returned, for tests/transport/test_posted_ahead.py (run in a process of its own)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ckpt_core.registry import create_checkpoint_engine

REFITS = 3
WAIT_S = 30.0
"""How long the rollout waits for the policy's send to return before receiving anyway: a
policy's first send also loads what a first refit needs, which took over 10 s in 2 of 11 runs
with the cores loaded (a passing run waits milliseconds)."""


def weights(refit: int) -> list[tuple[str, torch.Tensor]]:
    """Three small tensors, one bucket's worth, their values telling the refit."""
    return [(f"w{i}", torch.full((64, 64), float(10 * refit + i))) for i in range(3)]


def run(
    role: str, topology: str, metadata_out: Any, metadata_in: Any, sent: list[Any], done: Any, results: Any
) -> None:
    """``role`` ``"policy"`` sends :data:`REFITS` refits, setting ``sent[k]`` once the send of
    refit ``k`` returned, then waits for ``done`` before it finalizes (as a driver gathers both
    sides of a refit before it ends anything: a sender that drops its link at once can take
    bytes the rollout has not read with it); ``"rollout"`` waits up to :data:`WAIT_S` for
    ``sent[k]`` before each receive but the first, and sets ``done`` after the last. Each puts ``{"role",
    ...}`` on ``results`` (the policy: how long each send took; the rollout: whether each send
    after the first returned first, and what it received), or ``{"error": ...}``."""
    engine: Any = None
    try:
        engine = create_checkpoint_engine(
            "gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs={"topology": topology, "timeout_s": 30}
        )
        metadata_out.put(engine.prepare())
        metadata = metadata_in.get(timeout=60)
        sizes = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
        if role == "policy":
            engine.init_policy_process_group(worker_rank=0, **sizes)
            seconds = []
            for refit in range(REFITS):
                started = time.monotonic()
                engine.send_weights_blocking(item for item in weights(refit))
                seconds.append(time.monotonic() - started)
                sent[refit].set()
            if not done.wait(2 * WAIT_S * REFITS):
                raise TimeoutError(f"the rollout did not receive all {REFITS} refits in time")
            results.put({"role": role, "send_seconds": seconds})
            return
        engine.init_rollout_process_group(rollout_rank=0, **sizes)
        first: list[bool | None] = []
        received: list[list[tuple[str, list[float]]]] = []
        for refit in range(REFITS):
            # Refit 0 has nothing posted ahead (not at connect): it is received at once.
            first.append(sent[refit].wait(WAIT_S) if refit else None)
            batches = engine.receive_weight_batches_blocking(owned=True)
            received.append([(name, sorted(set(t.flatten().tolist()))) for batch in batches for name, t in batch])
        done.set()
        results.put({"role": role, "sent_first": first, "received": received})
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put({"role": role, "error": f"{role}: {type(exc).__name__}: {exc}"})
    finally:
        if engine is not None:
            engine.finalize()
