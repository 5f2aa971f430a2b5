"""``ckpt-engine``: list installed backends, and benchmark a refit against the transport floor.

ckpt-engine list [--json] [--no-options]
ckpt-engine bench [--backend gloo_cpu] [--size 1GiB | --model PATH] [--bucket-size 64MiB]
                  [--policy 1] [--rollout 2] [--topology broadcast] [--refits 3]
                  [--option KEY=VALUE ...] [--launcher local|ray [--ray-address ADDR]]
                  [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from ckpt_core.bench import PRODUCE_MODES

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"1GiB"`` -> 1073741824; plain integers are bytes. ``argparse.ArgumentTypeError`` else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 64MiB or 1GiB")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; VALUE is read as JSON when it parses (numbers, true/false), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"engine options are KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt-engine", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("list", help="installed backends, their load status and capabilities")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.add_argument(
        "--no-options", action="store_true", help="leave out each backend's options (name, default, doc)"
    )

    bench = commands.add_parser("bench", help="refit between local processes and compare with raw Gloo")
    source = bench.add_mutually_exclusive_group()
    source.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("1GiB"),
        help="total size of a synthetic transformer-shaped state dict (default 1GiB)",
    )
    source.add_argument("--model", help="a .safetensors file or a directory of them, streamed lazily")
    bench.add_argument("--backend", default="gloo_cpu", help="backend name or module:Class (default gloo_cpu)")
    bench.add_argument("--bucket-size", type=parse_size, default=parse_size("64MiB"), help="default 64MiB")
    bench.add_argument("--policy", type=int, default=1, help="policy processes (default 1)")
    bench.add_argument("--rollout", type=int, default=2, help="rollout processes (default 2)")
    bench.add_argument(
        "--topology",
        choices=("broadcast", "paired"),
        default=None,
        help="engine topology (default: the engine's own, broadcast for gloo_cpu)",
    )
    bench.add_argument("--device", default=None, help="engine device option, e.g. cpu for cuda_ipc")
    bench.add_argument("--refits", type=int, default=3, help="timed refits after one warm-up (default 3)")
    bench.add_argument(
        "--produce",
        choices=PRODUCE_MODES,
        default=None,
        help="make each weight while the refit runs, as a trainer does: cast-bf16 (from fp32 masters) "
        "or fill (allocate and fill); default: weights made ready before the refit",
    )
    bench.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine option (repeatable)",
    )
    bench.add_argument("--timeout", type=float, default=300.0, help="engine timeout_s (default 300)")
    bench.add_argument("--no-baseline", action="store_true", help="skip the raw Gloo measurement")
    bench.add_argument("--no-progress", action="store_true", help="no live progress line")
    bench.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default="local",
        help="run the workers as local processes (default) or as Ray actors",
    )
    bench.add_argument(
        "--ray-address", default=None, help="with --launcher ray: join this Ray cluster (default: start a local one)"
    )
    bench.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "list":
        return _list(args)
    return _bench(args)


def _list(args: argparse.Namespace) -> int:
    from ckpt_core.registry import list_backends

    infos = list_backends(details=True)
    if args.json:
        print(json.dumps([info.to_dict() for info in infos], indent=2))
        return 0
    if not infos:
        print("no backends installed: pip install ckpt-gloo-cpu (or ckpt-nccl, ckpt-cuda-ipc)")
        return 0
    rows = [("backend", "distribution", "version", "status", "devices", "topologies", "placements")]
    notes = []
    for info in infos:
        if not info.loads:
            status = "broken"
            notes.append(f"{info.name}: {info.error}")
        elif info.unavailable_reason:
            status = "not usable here"
            notes.append(f"{info.name}: {info.unavailable_reason}")
        else:
            status = "ok"
        caps = info.capabilities
        rows.append(
            (
                info.name,
                info.distribution,
                info.version,
                status,
                ",".join(caps.devices) if caps else "-",
                ",".join(caps.topologies) if caps else "-",
                ",".join(caps.placements) if caps else "-",
            )
        )
    print(_table(rows))
    for note in notes:
        print(f"  {note}")
    if not args.no_options:
        for info in infos:
            if info.options is not None:
                print(f"\n{info.name} options (engine_kwargs; defaults as used when not passed):")
                print(_options_table(info.options))
    return 0


def _options_table(options: tuple[dict[str, Any], ...]) -> str:
    """A backend's options schema (``OptionSchema.describe()``) as a table; an option that every
    worker must set alike is marked, and one passed otherwise says how."""
    rows: list[tuple[Any, ...]] = [("  option", "default", "accepts", "meaning")]
    for option in options:
        name = option["name"] + (" *" if option["agreed"] else "")
        if option.get("argument"):
            name += f" (as {option['argument']})"
        rows.append((f"  {name}", option["default"], option["accepts"], option["doc"]))
    return _table(rows) + "\n  * the same value on every worker of one refit"


def _table(rows: list[tuple[Any, ...]]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _bench(args: argparse.Namespace) -> int:
    from ckpt_core.bench.job import BenchConfig, run_bench
    from ckpt_core.errors import (
        BackendImportError,
        DuplicateBackendError,
        EngineOptionError,
        NotAnEngineError,
        UnknownBackendError,
    )
    from ckpt_core.options import schema_of
    from ckpt_core.registry import check_engine_kwargs, resolve_backend

    if args.ray_address and args.launcher != "ray":
        _build_parser().error("--ray-address needs --launcher ray")
    try:  # here, before any worker starts: a missing plugin is a one-line fix, not a worker's traceback
        engine_class = resolve_backend(args.backend)
    except (UnknownBackendError, BackendImportError, DuplicateBackendError, NotAnEngineError) as exc:
        default = " (the default backend)" if args.backend == "gloo_cpu" else ""
        print(f"ckpt-engine bench: backend {args.backend!r}{default} cannot be used: {exc}", file=sys.stderr)
        return 2

    schema = schema_of(engine_class)
    engine_kwargs: dict[str, Any] = dict(args.option)
    if schema is None or "timeout_s" in schema:  # an engine without the option keeps its own deadline
        engine_kwargs.setdefault("timeout_s", args.timeout)
    if args.topology:
        engine_kwargs["topology"] = args.topology
    if args.device:
        engine_kwargs["device"] = args.device
    try:  # names and values, as the engine will parse them, before any worker starts
        check_engine_kwargs(engine_class, engine_kwargs)
        if schema is not None:
            schema.parse(engine_class.__name__, {"bucket_size": args.bucket_size, **engine_kwargs})
    except EngineOptionError as exc:
        print(f"ckpt-engine bench: {exc}", file=sys.stderr)
        return 2
    config = BenchConfig(
        backend=args.backend,
        size_bytes=None if args.model else args.size,
        model=args.model,
        bucket_size=args.bucket_size,
        num_policy=args.policy,
        num_rollout=args.rollout,
        refits=args.refits,
        engine_kwargs=engine_kwargs,
        baseline=not args.no_baseline,
        progress=not args.no_progress and args.launcher == "local" and sys.stderr.isatty() or False,
        launcher=args.launcher,
        ray_address=args.ray_address,
        produce=args.produce,
    )
    started = time.time()
    result = run_bench(config)
    print(format_bench(result))
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(result, handle, indent=2)
        print(f"wrote {args.json_path}")
    print(
        f"bit-exact: every received tensor matched its source ({result['tensors']} tensors x "
        f"{config.num_rollout} ranks x {config.refits + 1} refits); {time.time() - started:.1f} s in all"
    )
    return 0


def format_bench(result: dict[str, Any]) -> str:
    cfg = result["config"]
    head = (
        f"{cfg['backend']} {cfg['topology']} {cfg['num_policy']}->{cfg['num_rollout']}, "
        f"{result['payload_bytes'] / 2**20:.0f} MiB in {result['tensors']} tensors, "
        f"bucket {cfg['bucket_size'] / 2**20:g} MiB, median of {cfg['refits']} refits"
        + (f", weights produced during the refit ({cfg['produce']})" if cfg.get("produce") else "")
    )
    rows: list[tuple[Any, ...]] = [
        ("rank", "GB/s", "seconds", "pack s", "transfer s", "unpack s", "checksum s", "peak RSS MiB")
    ]
    for entry in result["policy"] + result["rollout"]:
        rows.append(
            (
                entry["label"],
                f"{entry['gbps']:.2f}",
                f"{entry['seconds']:.3f}",
                f"{entry['pack_seconds']:.3f}",
                f"{entry['transfer_seconds']:.3f}",
                f"{entry['unpack_seconds']:.3f}",
                f"{entry['checksum_seconds']:.3f}",
                f"{entry['lifetime_peak_rss_bytes'] / 2**20:.0f}",
            )
        )
    lines = [head, _table(rows)]
    floor = result.get("baseline")
    if floor:
        lines.append(
            f"raw torch.distributed Gloo {floor['topology']}, same bytes as one tensor: {floor['gbps']:.2f} GB/s "
            f"(median of {len(floor['seconds'])}); ratio {result['ratio_to_baseline']:.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
