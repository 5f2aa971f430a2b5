"""``python -m benchmarks.against REV``: this tree's benchmarks beside another revision's.

A change is a regression only if it shows against the tree before it on the same machine in
the same hour: machines of this kind differ 2x in speed, and one machine drifts by a fifth
between runs. So this checks ``REV`` out into a temporary worktree and runs ``benchmarks.run``
(with the options after ``--``) alternately from that tree and from this one, ``--runs``
times each, then compares, case by case, the median over the runs of each run's figures:
GB/s, the ratios to the baselines measured beside them, and peak memory over the bounds' base.

The other tree runs with this environment's packages, its own sources first on ``PYTHONPATH``
(the core, every plugin and integration), so it must import with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def source_paths(tree: Path) -> list[str]:
    """The import roots of a checkout: itself, and each plugin and integration folder."""
    return [str(tree)] + [str(p) for p in sorted((*tree.glob("plugins/*"), *tree.glob("integrations/*"))) if p.is_dir()]


def run_benchmarks(tree: Path, out: Path, options: list[str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*source_paths(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "benchmarks.run", "--no-plot", "--out", str(out), *options]
    print(f"[{tree.name}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)


def figures(doc: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, float | None]]:
    """Per refit case: GB/s, x raw Gloo, x memcpy, and sender / receiver MiB over their base."""
    out: dict[tuple[str, str, int], dict[str, float | None]] = {}
    for case in doc["cases"]:
        if case["kind"] != "refit" or case.get("error"):
            continue
        memory = case.get("memory") or {}
        out[(case["key"], case["payload"], case["bucket_size"] >> 20)] = {
            "gbps": case["gbps"],
            "x_raw": case["ratios"].get("raw_gloo"),
            "x_memcpy": case["ratios"].get("memcpy"),
            "sender_mib": _mib(memory.get("sender_over_weights_bytes")),
            "receiver_mib": _mib(memory.get("receiver_over_payload_bytes")),
        }
    per_tensor = doc.get("per_tensor") or {}
    if per_tensor.get("refit_over_floor") is not None:
        out[("per_tensor", "us and x floor", 0)] = {
            "gbps": per_tensor.get("refit_us_per_tensor"),
            "x_raw": per_tensor.get("refit_over_floor"),
            "x_memcpy": per_tensor.get("borrowed_refit_over_floor"),
            "sender_mib": None,
            "receiver_mib": None,
        }
    return out


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def median_figures(runs: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, float | None]]:
    merged: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    for doc in runs:
        for key, values in figures(doc).items():
            for name, value in values.items():
                merged.setdefault(key, {}).setdefault(name, [])
                if value is not None:
                    merged[key][name].append(value)
    return {
        key: {
            name: (max(v) if name.endswith("_mib") else statistics.median(v)) if v else None
            for name, v in values.items()
        }
        for key, values in merged.items()
    }


def table(rev: str, old: dict[Any, Any], new: dict[Any, Any], runs: int) -> str:
    def num(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    def mib(values: dict[str, float | None]) -> str:
        parts = [values.get("sender_mib"), values.get("receiver_mib")]
        return " / ".join("n/a" if v is None else f"{v:.0f}" for v in parts)

    lines = [
        f"This tree beside {rev}: {runs} alternating runs each; per case the median over runs "
        "(memory: the maximum). The per-tensor row gives us per tensor, x its floor, and "
        "x its floor with borrow_received_tensors.",
        "",
        f"| case | payload | bucket MiB | GB/s {rev} | GB/s now | x raw Gloo {rev} | x raw Gloo now | "
        f"x memcpy {rev} | x memcpy now | MiB over, sender / receiver, {rev} | now |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in sorted(set(old) | set(new)):
        o, n = old.get(key, {}), new.get(key, {})
        cells = [num(side.get(name)) for name in ("gbps", "x_raw", "x_memcpy") for side in (o, n)]
        lines.append(f"| {key[0]} | {key[1]} | {key[2] or ''} | {' | '.join(cells)} | {mib(o)} | {mib(n)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.against", description=__doc__.split("\n")[0])
    parser.add_argument("rev", help="the revision to compare with (a commit, tag or branch)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of each tree (default 3)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "against")
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, options = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser.epilog = "Options for benchmarks.run follow a --."
    args = parser.parse_args(ours)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-against-") as scratch:
        worktree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), args.rev], cwd=REPO, check=True)
        try:
            runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            for index in range(args.runs):
                for side, tree in (("old", worktree), ("new", REPO)):
                    out = Path(scratch) / f"{side}{index}"
                    run_benchmarks(tree, out, options)
                    runs[side].append(json.loads((out / "benchmarks.json").read_text()))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    old, new = median_figures(runs["old"]), median_figures(runs["new"])
    report = table(args.rev, old, new, args.runs)
    (args.out / "against.md").write_text(report)
    (args.out / "against.json").write_text(
        json.dumps(
            {"rev": args.rev, "runs": args.runs, "options": options, "old": _jsonable(old), "new": _jsonable(new)},
            indent=1,
        )
    )
    print(report)
    return 0


def _jsonable(table: dict[tuple[str, str, int], dict[str, float | None]]) -> list[dict[str, Any]]:
    return [{"case": k[0], "payload": k[1], "bucket_mib": k[2], **v} for k, v in sorted(table.items())]


if __name__ == "__main__":
    raise SystemExit(main())
