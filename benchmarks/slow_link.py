"""``python -m benchmarks.slow_link``: delta against full refits over a link slower than memory.

Between nodes, a refit's bytes cross a network of 10-100 Gbit/s, slower than the memory a
loopback refit moves them through; a delta refit's fewer bytes then become less time (issue
50, point 3). This benchmark makes such a link on one machine and measures it: two network
namespaces joined by a veth pair, each end's egress limited by ``tc`` (a token bucket) to each
rate of ``--rates``, addressed from the link-local range (nothing routes there, and the
namespaces reach nothing else); the policy process joins one namespace, the rollout process the
other (``setns``, before either opens a socket); both are torn down after, also when the run
fails.

At each rate: ``--size`` of bf16 weights ready in the policy's memory, sent by ``gloo_cpu``
(paired) from one namespace to the other, by two pools at once: *full* and *delta*; before each
of ``--reps`` rounds both policies flip the lowest bit of ``--fraction`` of their elements
(each element independently), then each refits. The first refit of each pool is whole and
checked digest by digest, and so is each delta refit (so every one is bit-exact); times are the
engines' (the longer side's ``RefitStats.seconds``). The first ``--settle`` rounds are what a
stream pays once, while its sender learns what whole weights cost (it may send them whole,
measure that, and copy them again: :data:`ckpt_core.refit.delta.choice.EXPLORE`): recorded and reported, but not
in the medians, which are of the ``--reps`` rounds after them. Beside them, raw Gloo moving the same bytes
as one tensor over the same link: what the link gives.

It needs root (or ``CAP_NET_ADMIN``), ``ip`` and ``tc`` (iproute2) and network namespaces: where
any is missing it says which and exits with status 2, running nothing. Goals at 1% changed:
delta <= 0.15x full at 1 Gbit/s, <= 0.4x at 10 Gbit/s. Writes ``slow_link.json`` and
``slow_link.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckpt_core.bench.baselines import RawGlooWorker
from ckpt_core.cli import parse_size
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import RefitWorker, refit_worker_specs

from .delta import SteppingPolicy
from .methods import worker_env
from .outputs import write_results

HERE = Path(__file__).resolve().parent
GOALS = {1.0: 0.15, 10.0: 0.4}  # Gbit/s -> delta / full at 1% changed
ADDRESSES = ("169.254.77.1", "169.254.77.2")  # link-local: routed nowhere
_CLONE_NEWNET = 0x40000000


class MissingPrerequisite(RuntimeError):
    """What this machine lacks to make the link (the message says what)."""


def check_prerequisites() -> None:
    """``MissingPrerequisite`` naming the first thing missing: ``ip``, ``tc``, the right to
    make namespaces (root or ``CAP_NET_ADMIN``), or namespaces themselves."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise MissingPrerequisite(f"'{tool}' (iproute2) is not on PATH: install iproute2 to make the link")
    probe = f"ckpt-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise MissingPrerequisite(
            f"cannot make a network namespace ({made.stderr.strip() or made.returncode}): run as root or with "
            "CAP_NET_ADMIN, on a kernel with network namespaces"
        )
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _run(*command: str) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


@contextlib.contextmanager
def rate_limited_link(gbit_per_s: float) -> Iterator[tuple[str, str]]:
    """Two namespaces joined by a veth pair limited to ``gbit_per_s`` each way; yields their
    names, addresses :data:`ADDRESSES`; deleted (with the veth) on exit."""
    tag = uuid.uuid4().hex[:6]
    names = (f"ckpt-a-{tag}", f"ckpt-b-{tag}")
    ends = (f"cka{tag}", f"ckb{tag}")
    try:
        for name in names:
            _run("ip", "netns", "add", name)
        _run(
            "ip", "link", "add", ends[0], "netns", names[0], "type", "veth", "peer", "name", ends[1], "netns", names[1]
        )
        rate = f"{gbit_per_s:g}gbit"
        # The bucket holds a few ms of the rate (at least 1 MB), so TCP's bursts pass at the rate.
        burst = max(1 << 20, int(gbit_per_s * 1e9 / 8 * 0.002))
        for name, end, address in zip(names, ends, ADDRESSES):
            _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{address}/30", "dev", end)
            _run("ip", "netns", "exec", name, "ip", "link", "set", end, "up", "mtu", "9000")
            _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            _run(
                "ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", end, "root", "tbf",
                "rate", rate, "burst", str(burst), "latency", "50ms",
            )  # fmt: skip
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def enter_namespace(name: str) -> None:
    """Move this process into network namespace ``name`` (made by ``ip netns add``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        os.close(fd)


class NamespacedPolicy(SteppingPolicy):
    """:class:`benchmarks.delta.SteppingPolicy` in network namespace ``netns``."""

    def __init__(self, *, netns: str, **kwargs: Any) -> None:
        enter_namespace(netns)
        super().__init__(**kwargs)


class NamespacedRollout(RefitWorker):
    """A :class:`~ckpt_core.orchestration.worker.RefitWorker` in network namespace ``netns``."""

    def __init__(self, *, netns: str, **kwargs: Any) -> None:
        enter_namespace(netns)
        super().__init__(**kwargs)


class NamespacedRawGloo(RawGlooWorker):
    def __init__(self, *, netns: str, **kwargs: Any) -> None:
        enter_namespace(netns)
        super().__init__(**kwargs)


def open_pool(
    stack: contextlib.ExitStack, names: tuple[str, str], params: dict[str, Any], *, delta: bool
) -> RefitCoordinator:
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=1,
        bucket_size=32 << 20,
        engine_kwargs={"topology": "paired", "timeout_s": 300.0, "delta": delta},
        weights="benchmarks.delta:ready",
        weights_params=params,
    )
    for spec, name, address, service in zip(specs, names, ADDRESSES, ("NamespacedPolicy", "NamespacedRollout")):
        spec["service"] = f"benchmarks.slow_link:{service}"
        spec["netns"] = name
        spec["engine_kwargs"] = {**spec["engine_kwargs"], "host": address}
    tag = "delta" if delta else "full"
    pool = stack.enter_context(
        LocalProcessPool(specs, labels=[f"{tag}-{label}" for label in labels], env=worker_env(), start_method="spawn")
    )
    coordinator = RefitCoordinator(pool, num_policy=1, num_rollout=1, timeout_s=900.0, topology="paired")
    coordinator.setup()
    stack.callback(coordinator.finalize)
    return coordinator


def raw_gloo_seconds(names: tuple[str, str], nbytes: int, reps: int) -> float:
    specs = [
        {"service": "benchmarks.slow_link:NamespacedRawGloo", "netns": name, "rank": rank, "size": 2, "host": address}
        for rank, (name, address) in enumerate(zip(names, ADDRESSES))
    ]
    with LocalProcessPool(specs, labels=["raw-0", "raw-1"], env=worker_env(), start_method="spawn") as pool:
        (meta,) = [r.value for r in pool.call([(0, "prepare", {})], 60.0)]
        for result in pool.call([(i, "init", {"metadata": [meta, {}]}) for i in range(2)], 60.0):
            if not result.ok:
                raise RuntimeError(result.describe())
        results = pool.call(
            [(i, "transfer", {"nbytes": nbytes, "topology": "paired", "repetitions": reps}) for i in range(2)], 900.0
        )
        if not all(r.ok for r in results):
            raise RuntimeError("\n".join(r.describe() for r in results if not r.ok))
        return statistics.median(max(pair) for pair in zip(*(r.value["seconds"] for r in results)))


def engine_seconds(report: Any) -> tuple[float, int]:
    (policy,), (rollout,) = report.policy, report.rollout
    return max(policy["stats"]["seconds"], rollout["stats"]["seconds"]), int(rollout["stats"]["payload_bytes"])


def at_rate(gbit_per_s: float, params: dict[str, Any], fraction: float, reps: int, settle: int) -> dict[str, Any]:
    nbytes = 2 * int(params["tensors"]) * int(params["elements"])
    with rate_limited_link(gbit_per_s) as names, contextlib.ExitStack() as stack:
        raw = raw_gloo_seconds(names, nbytes, 3)
        pools = {
            "full": open_pool(stack, names, params, delta=False),
            "delta": open_pool(stack, names, params, delta=True),
        }
        for name, coordinator in pools.items():
            coordinator.refit()  # whole, checked digest by digest
            coordinator.verify = name == "delta"  # every delta refit checked too
        seconds: dict[str, list[float]] = {"full": [], "delta": []}
        moved: dict[str, list[int]] = {"full": [], "delta": []}
        for rep in range(settle + reps):
            for coordinator in pools.values():
                (result,) = coordinator.pool.call([(0, "step", {"fraction": fraction, "seed": 100 + rep})], 600.0)
                if not result.ok:
                    raise RuntimeError(result.describe())
            for name, coordinator in pools.items():
                took, nbytes_moved = engine_seconds(coordinator.refit())
                seconds[name].append(took)
                moved[name].append(nbytes_moved)
            print(
                f"{gbit_per_s:g} Gbit/s: full {seconds['full'][-1]:.3f} s, delta {seconds['delta'][-1]:.3f} s",
                flush=True,
            )
    full, delta = statistics.median(seconds["full"][settle:]), statistics.median(seconds["delta"][settle:])
    return {
        "gbit_per_s": gbit_per_s,
        "raw_gloo_seconds": raw,
        "raw_gloo_gbit_per_s": nbytes * 8 / raw / 1e9,
        "settle_rounds": settle,
        "full_seconds": seconds["full"],
        "delta_seconds": seconds["delta"],
        "full_median_s": full,
        "delta_median_s": delta,
        "delta_over_full": delta / full,
        "full_payload_bytes": statistics.median(moved["full"][settle:]),
        "delta_payload_bytes": statistics.median(moved["delta"][settle:]),
    }


def report(results: dict[str, Any]) -> str:
    setup = results["setup"]
    lines = [
        "Delta against full refits over a rate-limited veth between two network namespaces (gloo_cpu paired, "
        f"{setup['size'] / 2**20:.0f} MiB of bf16, {setup['fraction']:.0%} changed per refit, medians of "
        f"{setup['reps']} after {setup['settle']} rounds that settle the choice; every delta refit checked digest "
        "by digest).",
        "",
        "| link | raw Gloo, same bytes | full | delta | delta bytes | delta / full | goal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        goal = GOALS.get(row["gbit_per_s"])
        verdict = "" if goal is None else f"<= {goal}: {'met' if row['delta_over_full'] <= goal else 'missed'}"
        lines.append(
            f"| {row['gbit_per_s']:g} Gbit/s | {row['raw_gloo_seconds']:.3f} s "
            f"({row['raw_gloo_gbit_per_s']:.2f} Gbit/s) | {row['full_median_s']:.3f} s | "
            f"{row['delta_median_s']:.3f} s | {row['delta_payload_bytes'] / 2**20:.1f} MiB | "
            f"{row['delta_over_full']:.3f} | {verdict} |"
        )
    lines.append("")
    for row in results["rows"]:
        settled = ", ".join(f"{s:.3f}" for s in row["delta_seconds"][: row["settle_rounds"]])
        lines.append(f"Delta refits while settling at {row['gbit_per_s']:g} Gbit/s: {settled} s.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20)
    parser.add_argument("--elements-per-tensor", type=int, default=4096 * 4096)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 10.0], help="Gbit/s")
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--settle", type=int, default=6)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    try:
        check_prerequisites()
    except MissingPrerequisite as exc:
        print(f"benchmarks.slow_link cannot run here: {exc}", file=sys.stderr)
        return 2
    tensors = max(1, args.size // (2 * args.elements_per_tensor))
    params = {"seed": 1, "tensors": tensors, "elements": args.elements_per_tensor}
    rows = [at_rate(rate, params, args.fraction, args.reps, args.settle) for rate in args.rates]
    results = {
        "setup": {
            "size": 2 * tensors * args.elements_per_tensor,
            "fraction": args.fraction,
            "reps": args.reps,
            "settle": args.settle,
        },
        "rows": rows,
    }
    table = report(results)
    write_results(args.out, "slow_link", results, table)
    print(table)
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    status = main()
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    sys.exit(status)
