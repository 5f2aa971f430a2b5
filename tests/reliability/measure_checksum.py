"""``python tests/reliability/measure_checksum.py``: what the per-bucket checksum costs here.

Prints JSON: xxh3_64 throughput on one core (the core's ``payload_checksum`` over a warm
buffer), and gloo_cpu refit times (1 policy -> 1 rollout process, 64 MiB buckets) with
checksums on and off, measured alternately in one run so machine load hits both alike.
Numbers go to docs/reliability.md; this is a measurement, not a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.*

from ckpt_core._internal.checksum import payload_checksum  # noqa: E402
from tests.reliability.rel_team import Team  # noqa: E402

MIB = 1 << 20


def xxh3_gbps(nbytes: int = 256 * MIB, repeats: int = 7) -> float:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    payload_checksum(data)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        payload_checksum(data)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def refit_times(total_mib: int = 512, bucket_mib: int = 64, rounds: int = 6) -> dict[str, object]:
    sizes = [total_mib * MIB // 8] * 8
    team = Team(4)
    try:
        coordinators = {}
        for label, slots, checksum in (("on", (0, 1), True), ("off", (2, 3), False)):
            coordinator = team.coordinator(
                policy=[slots[0]],
                rollout=[slots[1]],
                backend="gloo_cpu",
                bucket_size=bucket_mib * MIB,
                engine_kwargs={"timeout_s": 120, "checksum": checksum},
                weights="tests.reliability.rel_weights:cached",
                weights_params={"sizes": sizes},
                verify=False,
            )
            coordinator.setup()
            coordinator.refit()  # warm-up: page faults, buffers
            coordinators[label] = coordinator
        seconds: dict[str, list[float]] = {"on": [], "off": []}
        checksum_seconds: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(rounds):
            for label, coordinator in coordinators.items():
                report = coordinator.refit()
                stats = report.rollout[0]["stats"]
                seconds[label].append(stats["seconds"])
                checksum_seconds[label].append(
                    stats["checksum_seconds"] + report.policy[0]["stats"]["checksum_seconds"]
                )
        for coordinator in coordinators.values():
            coordinator.finalize()
    finally:
        team.close()
    on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
    return {
        "payload_mib": total_mib,
        "bucket_mib": bucket_mib,
        "rounds": rounds,
        "refit_seconds_median": {"checksum_on": on, "checksum_off": off},
        "refit_gbps_median": {"checksum_on": total_mib * MIB / on / 1e9, "checksum_off": total_mib * MIB / off / 1e9},
        "checksum_seconds_median_both_sides": statistics.median(checksum_seconds["on"]),
        "overhead_percent": 100.0 * (on - off) / off,
        "all_seconds": seconds,
    }


if __name__ == "__main__":
    import os

    load_before = os.getloadavg()[0]
    result = {"xxh3_64_gbps_one_core": xxh3_gbps(), "gloo_cpu_refit": refit_times()}
    result["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    print(json.dumps(result, indent=2))
