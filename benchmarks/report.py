"""From samples to figures: medians, ratios to the baselines, targets, and the Markdown report.

Every ratio divides two medians of the same phase (the same stretch of time) and payload, so it
holds on a machine whose absolute speed drifts. Baselines by shape: a 1->1 case is compared with
raw Gloo send/recv and the naive 1->1 torch.save/load refit, a 1->2 case with raw Gloo broadcast
and the naive refit loaded by two processes at once.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from .harness import CaseRecord
from .units import format_size

SCHEMA = "ckpt-engine-benchmarks/1"
RAW_BY_SHAPE = {"1->1": "raw_paired", "1->2": "raw_broadcast"}
NAIVE_BY_SHAPE = {"1->1": "naive_torch_1to1", "1->2": "naive_torch_1to2"}
MEMCPY = "memcpy"
COPIES_BY_SHAPE = {"1->1": "memcpy_2proc", "1->2": "memcpy_3proc"}
"""A shared-memory refit copies every byte once in each process (the sender packs, every
receiver copies out), all at once: its ceiling is that many processes copying concurrently."""
PER_TENSOR_GROUP = "per-tensor overhead"
MiB = 1 << 20
SLACK = 64 * MiB
_STAT_FIELDS = ("seconds", "pack_seconds", "transfer_seconds", "unpack_seconds", "checksum_seconds", "buckets")


def _over(role: str, peak: int, base: int, payload: int) -> int:
    """Peak memory above what the process must hold: its weights (sender, and a local copy's
    source), or what it yields (a receiver that keeps it; ``payload`` is 0 for one that does
    not). A local copy's destination buffer counts as over."""
    return peak - base - payload


def summarize_case(record: CaseRecord) -> dict[str, Any]:
    payload = record.payload
    seconds = [s.seconds for s in record.samples]
    summary: dict[str, Any] = {
        "group": record.group,
        **{k: record.method[k] for k in ("key", "label", "kind", "shape", "bucket_size")},
        "payload": payload.label,
        "payload_bytes": payload.payload_bytes,
        "tensors": payload.tensors,
        "reps": len(seconds),
        "seconds": seconds,
        "median_seconds": statistics.median(seconds) if seconds else None,
        "gbps": None,
        "min_gbps": None,
        "max_gbps": None,
        "memory": None,
        "cpu_seconds": None,
        "stats": None,
        "ratios": {},
        "error": record.error,
    }
    if seconds:
        summary["gbps"] = payload.payload_bytes / summary["median_seconds"] / 1e9
        summary["min_gbps"] = payload.payload_bytes / max(seconds) / 1e9
        summary["max_gbps"] = payload.payload_bytes / min(seconds) / 1e9
        summary["memory"] = _memory(record)
        summary["cpu_seconds"] = _cpu(record)
        summary["stats"] = _stats(record)
    return summary


def _memory(record: CaseRecord) -> dict[str, Any]:
    payload = record.payload.payload_bytes
    workers: dict[str, dict[str, Any]] = {}
    for sample in record.samples:
        for w in sample.workers:
            entry = workers.setdefault(
                w.label,
                {
                    "label": w.label,
                    "role": w.role,
                    "rss_base_bytes": w.rss_base_bytes,
                    "rss_peak_bytes": 0,
                    "over_bytes": None,
                },
            )
            entry["rss_peak_bytes"] = max(entry["rss_peak_bytes"], w.rss_peak_bytes)
            held = payload if w.role != "receiver" or record.method.get("receiver_holds_payload", True) else 0
            over = _over(w.role, w.rss_peak_bytes, w.rss_base_bytes, held)
            entry["over_bytes"] = over if entry["over_bytes"] is None else max(entry["over_bytes"], over)
    by_role: dict[str, int | None] = {"sender": None, "receiver": None}
    for entry in workers.values():
        if entry["role"] in by_role:
            current = by_role[entry["role"]]
            by_role[entry["role"]] = entry["over_bytes"] if current is None else max(current, entry["over_bytes"])
    return {
        "sender_over_weights_bytes": by_role["sender"],
        "receiver_over_payload_bytes": by_role["receiver"],
        "workers": list(workers.values()),
    }


def _cpu(record: CaseRecord) -> dict[str, float]:
    """Median over samples of the CPU seconds of the busiest process of each role."""
    per_role: dict[str, list[float]] = {}
    for sample in record.samples:
        busiest: dict[str, float] = {}
        for w in sample.workers:
            busiest[w.role] = max(busiest.get(w.role, 0.0), w.cpu_seconds)
        for role, seconds in busiest.items():
            per_role.setdefault(role, []).append(seconds)
    return {role: statistics.median(values) for role, values in per_role.items()}


def _stats(record: CaseRecord) -> dict[str, dict[str, float]] | None:
    """Median of each pipeline statistic per role (refits only)."""
    per_role: dict[str, list[dict[str, Any]]] = {}
    for sample in record.samples:
        for w in sample.workers:
            if w.stats:
                per_role.setdefault(w.role, []).append(w.stats)
    if not per_role:
        return None
    return {
        role: {f: statistics.median(s[f] for s in stats) for f in _STAT_FIELDS if f in stats[0]}
        for role, stats in per_role.items()
    }


def _ratio(case: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """``case``'s GB/s over ``base``'s; ``None`` where either is missing (or ``base`` is ``case``)."""
    if base is None or base is case or not base["gbps"] or case["gbps"] is None:
        return None
    return float(case["gbps"] / base["gbps"])


def add_ratios(cases: list[dict[str, Any]]) -> None:
    """``ratios[name]`` = this case's GB/s over the baseline's, same group and payload."""
    index = {(c["group"], c["key"], c["payload"]): c for c in cases}
    for case in cases:
        baselines = {
            "raw_gloo": RAW_BY_SHAPE.get(case["shape"]),
            "memcpy": MEMCPY,
            "copies_at_once": COPIES_BY_SHAPE.get(case["shape"]) if case["kind"] == "refit" else None,
            "naive_torch": NAIVE_BY_SHAPE.get(case["shape"]),
        }
        for name, key in baselines.items():
            base = index.get((case["group"], key, case["payload"])) if key else None
            case["ratios"][name] = _ratio(case, base)


# --- targets ---------------------------------------------------------------------------


def _check(case: dict[str, Any], value: float | None, limit: float, *, at_most: bool = False) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"payload": case["payload"], "bucket_size": case["bucket_size"], "value": value, "limit": limit, "met": met}


def _target(
    target_id: str, text: str, method: str, unit: str, checks: list[dict[str, Any]], *, at_most: bool = False
) -> dict[str, Any]:
    measured = [c for c in checks if c["met"] is not None]
    if not measured:
        met, worst = None, None
    else:
        met = all(c["met"] for c in measured)
        if at_most:
            worst = max(measured, key=lambda c: c["value"] - c["limit"])
        else:
            worst = min(measured, key=lambda c: c["value"] / c["limit"] if c["limit"] else c["value"])
    return {
        "id": target_id,
        "target": text,
        "method": method,
        "unit": unit,
        "met": met,
        "worst": worst,
        "checks": checks,
        "unmeasured": len(checks) - len(measured),
    }


def evaluate_targets(cases: list[dict[str, Any]], largest: dict[str, int]) -> list[dict[str, Any]]:
    """The issue's targets, each checked on every (payload, bucket) it applies to."""
    refits = [c for c in cases if c["kind"] == "refit" and c["group"] != PER_TENSOR_GROUP]

    def of(key: str, min_bucket: int = 0) -> list[dict[str, Any]]:
        return [c for c in refits if c["key"] == key and (c["bucket_size"] or 0) >= min_bucket]

    def ratio_checks(key: str, baseline: str, limit: float, min_bucket: int = 0) -> list[dict[str, Any]]:
        return [_check(c, c["ratios"].get(baseline), limit) for c in of(key, min_bucket)]

    def gloo_ratio_checks(key: str, gloo_key: str) -> list[dict[str, Any]]:
        index = {(c["group"], c["payload"]): c for c in of(gloo_key)}
        checks = []
        for c in of(key):
            checks.append(_check(c, _ratio(c, index.get((c["group"], c["payload"]))), 2.0))
        return checks

    targets = [
        _target(
            "gloo_vs_raw",
            ">= 0.9x raw Gloo send/recv, buckets >= 64 MiB",
            "gloo_paired",
            "x",
            ratio_checks("gloo_paired", "raw_gloo", 0.9, 64 * MiB),
        ),
        _target(
            "gloo_vs_raw",
            ">= 0.9x raw Gloo broadcast, buckets >= 64 MiB",
            "gloo_broadcast",
            "x",
            ratio_checks("gloo_broadcast", "raw_gloo", 0.9, 64 * MiB),
        ),
    ]
    for key, gloo_key in (("ipc_1to1", "gloo_paired"), ("ipc_1to2", "gloo_broadcast")):
        targets.append(_target("ipc_vs_memcpy", ">= 0.5x memcpy", key, "x", ratio_checks(key, "memcpy", 0.5)))
        targets.append(
            _target("ipc_vs_gloo", f">= 2x gloo_cpu ({gloo_key})", key, "x", gloo_ratio_checks(key, gloo_key))
        )
    for key in ("gloo_paired", "gloo_broadcast", "ipc_1to1", "ipc_1to2"):
        targets.append(
            _target("vs_naive", ">= 2x naive torch.save/torch.load", key, "x", ratio_checks(key, "naive_torch", 2.0))
        )
    per_tensor = [c for c in cases if c["group"] == PER_TENSOR_GROUP and c["kind"] == "refit"]
    targets.append(
        _target(
            "per_tensor",
            "<= 20 us per tensor end to end",
            "gloo_paired",
            "us",
            [
                _check(c, c["median_seconds"] / c["tensors"] * 1e6 if c["median_seconds"] else None, 20.0, at_most=True)
                for c in per_tensor
            ],
            at_most=True,
        )
    )
    for key in ("gloo_paired", "gloo_broadcast", "ipc_1to1", "ipc_1to2"):
        sender, receiver = [], []
        for c in of(key):
            memory = c["memory"] or {}
            bucket = c["bucket_size"]
            sender.append(
                _check(c, _mib(memory.get("sender_over_weights_bytes")), (2 * bucket + SLACK) / MiB, at_most=True)
            )
            limit = (2 * bucket + largest.get(c["payload"], 0) + SLACK) / MiB
            receiver.append(_check(c, _mib(memory.get("receiver_over_payload_bytes")), limit, at_most=True))
        targets.append(
            _target(
                "sender_memory", "sender peak RSS above weights <= 2 buckets + 64 MiB", key, "MiB", sender, at_most=True
            )
        )
        targets.append(
            _target(
                "receiver_memory",
                "receiver peak RSS above what it yields <= 2 buckets + largest tensor + 64 MiB",
                key,
                "MiB",
                receiver,
                at_most=True,
            )
        )
    return targets


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / MiB


def per_tensor_summary(cases: list[dict[str, Any]], floor_seconds: float | None = None) -> dict[str, Any] | None:
    """The per-tensor case: the default refit, the borrowing one, raw Gloo, and the view
    floor (:mod:`benchmarks.per_tensor_floor`), with each refit's ratio to that floor."""
    refit = next((c for c in cases if c["group"] == PER_TENSOR_GROUP and c["key"] == "gloo_paired"), None)
    borrowed = next((c for c in cases if c["group"] == PER_TENSOR_GROUP and c["key"] == "gloo_paired_borrowed"), None)
    raw = next((c for c in cases if c["group"] == PER_TENSOR_GROUP and c["key"] == "raw_paired"), None)
    if refit is None:
        return None
    count = refit["tensors"]

    def us(case: dict[str, Any] | None) -> float | None:
        return case["median_seconds"] / count * 1e6 if case and case["median_seconds"] else None

    def over_floor(case: dict[str, Any] | None) -> float | None:
        if case is None or not case["median_seconds"] or not floor_seconds:
            return None
        return float(case["median_seconds"] / floor_seconds)

    return {
        "tensors": count,
        "tensor_bytes": refit["payload_bytes"] // count,
        "bucket_size": refit["bucket_size"],
        "refit_us_per_tensor": us(refit),
        "borrowed_refit_us_per_tensor": us(borrowed),
        "raw_gloo_us_per_tensor": us(raw),
        "floor_us_per_tensor": floor_seconds / count * 1e6 if floor_seconds else None,
        "refit_over_floor": over_floor(refit),
        "borrowed_refit_over_floor": over_floor(borrowed),
        "refit_seconds": refit["median_seconds"],
        "borrowed_refit_seconds": borrowed["median_seconds"] if borrowed else None,
        "raw_gloo_seconds": raw["median_seconds"] if raw else None,
        "floor_seconds": floor_seconds,
        "error": refit["error"] or (raw["error"] if raw else "raw floor not measured"),
    }


# --- Markdown --------------------------------------------------------------------------


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _gbps(case: dict[str, Any] | None) -> str:
    if case is None:
        return ""
    if case["gbps"] is None:
        return "failed" if case["error"] else "n/a"
    return f"{case['gbps']:.2f}"


def _mib_text(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MiB:.0f}"


def _bucket(case: dict[str, Any]) -> str:
    return format_size(case["bucket_size"]) if case["bucket_size"] else "-"


def render_markdown(doc: dict[str, Any]) -> str:
    cases: list[dict[str, Any]] = doc["cases"]
    config = doc["config"]
    lines = [
        "# ckpt-engine benchmarks",
        "",
        f"Generated by `python -m benchmarks.run` on {doc['created_utc']} "
        f"({doc['environment']['cpus']} CPUs, {doc['environment']['memory_gib']:.0f} GiB, torch "
        f"{doc['environment']['torch']}; load average {doc['environment']['load_before']} before, "
        f"{doc['environment']['load_after']} after). Medians of {config['reps']} repetitions after a warm-up, "
        "methods measured round-robin; GB/s = 1e9 bytes/s of payload, end to end (first byte the sender "
        "handles to the last receiver holding every tensor). Ratios compare medians of the same phase. "
        "*CPU s* is the CPU time (all threads) of the busiest process of each role during one transfer, "
        "median: on a shared 2-core machine it shows what a method costs when wall time is noisy.",
        "",
    ]
    for payload in doc["payloads"]:
        lines += _payload_tables(cases, payload["label"])
    lines += _targets_table(doc["targets"])
    per_tensor = doc.get("per_tensor")
    if per_tensor:
        lines += [
            "## Per-tensor overhead",
            "",
            f"{per_tensor['tensors']} tensors of {per_tensor['tensor_bytes']} B, gloo_cpu paired 1->1, "
            f"bucket {format_size(per_tensor['bucket_size'])}.",
            "",
            "| | seconds | us per tensor | x floor |",
            "| --- | --- | --- | --- |",
            f"| ckpt-engine refit | {_num(per_tensor['refit_seconds'], 3)} | "
            f"{_num(per_tensor['refit_us_per_tensor'], 1)} | {_x(per_tensor.get('refit_over_floor'))} |",
            f"| ckpt-engine refit, borrow_received_tensors | {_num(per_tensor.get('borrowed_refit_seconds'), 3)} | "
            f"{_num(per_tensor.get('borrowed_refit_us_per_tensor'), 1)} "
            f"| {_x(per_tensor.get('borrowed_refit_over_floor'))} |",
            f"| raw Gloo send/recv, same bytes as one tensor | {_num(per_tensor['raw_gloo_seconds'], 3)} | "
            f"{_num(per_tensor['raw_gloo_us_per_tensor'], 1)} | |",
            f"| floor: a uint8 view per tensor + cutting one buffer into the tensors | "
            f"{_num(per_tensor.get('floor_seconds'), 3)} | {_num(per_tensor.get('floor_us_per_tensor'), 1)} | 1.00x |",
            "",
        ]
    errors = [c for c in cases if c["error"]]
    if errors:
        lines += ["## Errors", ""]
        seen = set()
        for case in errors:
            key = (case["key"], case["bucket_size"], case["error"])
            if key in seen:
                continue
            seen.add(key)
            first = case["error"].splitlines()[0]
            lines.append(f"- {case['label']} ({case['group']}): `{first[:300]}`")
        lines.append("")
    lines += [
        "## How memory is measured",
        "",
        doc["memory_method"],
        "",
    ]
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _payload_tables(cases: list[dict[str, Any]], payload: str) -> list[str]:
    mine = [c for c in cases if c["payload"] == payload and c["group"] != PER_TENSOR_GROUP]
    refits = [c for c in mine if c["kind"] == "refit"]
    lines = [
        f"## {payload} payload",
        "",
        "| method | shape | bucket | GB/s | x raw Gloo | x memcpy | x copies at once | x naive torch.save "
        "| CPU s, sender / receiver | sender MiB over weights | receiver MiB over payload |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(refits, key=lambda c: (_order(c["key"]), c["bucket_size"] or 0)):
        memory = c["memory"] or {}
        lines.append(
            f"| {c['label']} | {c['shape']} | {_bucket(c)} | {_gbps(c)} | {_x(c['ratios'].get('raw_gloo'))} | "
            f"{_x(c['ratios'].get('memcpy'))} | {_x(c['ratios'].get('copies_at_once'))} | "
            f"{_x(c['ratios'].get('naive_torch'))} | {_cpu_text(c)} | "
            f"{_mib_text(memory.get('sender_over_weights_bytes'))} | "
            f"{_mib_text(memory.get('receiver_over_payload_bytes'))} |"
        )
    groups = list(dict.fromkeys(c["group"] for c in mine))
    baselines = [c for c in mine if c["kind"] != "refit"]
    keys = list(dict.fromkeys(c["key"] for c in sorted(baselines, key=lambda c: _order(c["key"]))))
    if keys:
        lines += [
            "",
            f"Baselines, {payload} (GB/s measured beside each bucket size's refits; median across them):",
            "",
            "| baseline | shape | "
            + " | ".join(f"beside {g.removeprefix('bucket ')}" for g in groups)
            + " | median | CPU s, sender / receiver | sender MiB over weights | receiver MiB over payload |",
            "| --- | --- | " + " | ".join("---" for _ in groups) + " | --- | --- | --- | --- |",
        ]
        for key in keys:
            row = {c["group"]: c for c in baselines if c["key"] == key}
            any_case = next(iter(row.values()))
            values = [c["gbps"] for c in row.values() if c["gbps"] is not None]
            median = f"{statistics.median(values):.2f}" if values else "n/a"
            memory = [c["memory"] for c in row.values() if c["memory"]]
            lines.append(
                f"| {any_case['label']} | {any_case['shape']} | "
                + " | ".join(_gbps(row.get(g)) for g in groups)
                + f" | {median} | "
                f"{_cpu_text(_middle(list(row.values())))} | "
                f"{_max_mib(memory, 'sender_over_weights_bytes')} | "
                f"{_max_mib(memory, 'receiver_over_payload_bytes')} |"
            )
    lines.append("")
    return lines


def _cpu_text(case: dict[str, Any] | None) -> str:
    cpu = (case or {}).get("cpu_seconds") or {}
    if "local" in cpu:
        return f"{cpu['local']:.2f}"
    if not cpu:
        return "n/a"
    return " / ".join(f"{cpu[r]:.2f}" if r in cpu else "-" for r in ("sender", "receiver"))


def _middle(cases: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The case whose GB/s is the median of ``cases`` (for figures that go with it)."""
    measured = sorted((c for c in cases if c["gbps"] is not None), key=lambda c: c["gbps"])
    return measured[len(measured) // 2] if measured else None


def _max_mib(memory: list[dict[str, Any]], field: str) -> str:
    values = [m[field] for m in memory if m.get(field) is not None]
    return _mib_text(max(values)) if values else "-"


_ORDER = (
    "gloo_paired",
    "gloo_paired_checksum",
    "gloo_broadcast",
    "ipc_1to1",
    "ipc_1to2",
    "raw_paired",
    "raw_paired_pieces",
    "raw_broadcast",
    "memcpy",
    "memcpy_2proc",
    "memcpy_3proc",
    "naive_torch_1to1",
    "naive_torch_1to2",
    "naive_safetensors_1to1",
)


def _order(key: str) -> int:
    return _ORDER.index(key) if key in _ORDER else len(_ORDER)


def _targets_table(targets: Iterable[dict[str, Any]]) -> list[str]:
    lines = [
        "## Targets",
        "",
        "Each target is checked on every payload and bucket size it applies to; *worst* is the case "
        "closest to (or furthest past) its limit.",
        "",
        "| target | method | result | worst case | checks missed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        result = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        worst = t["worst"]
        if worst is None:
            worst_text = "n/a"
        else:
            where = worst["payload"] + (f" @ {format_size(worst['bucket_size'])}" if worst["bucket_size"] else "")
            unit = t["unit"]
            value = f"{worst['value']:.2f}{unit}" if unit == "x" else f"{worst['value']:.1f} {unit}"
            limit = f"{worst['limit']:.2f}{unit}" if unit == "x" else f"{worst['limit']:.1f} {unit}"
            worst_text = f"{value} (limit {limit}; {where})"
        missed = [c for c in t["checks"] if c["met"] is False]
        missed_text = (
            ", ".join(
                c["payload"] + (f" @ {format_size(c['bucket_size'])}" if c["bucket_size"] else "") for c in missed
            )
            or "none"
        )
        if t["unmeasured"]:
            missed_text += f" ({t['unmeasured']} not measured)"
        lines.append(f"| {t['target']} | {t['method']} | {result} | {worst_text} | {missed_text} |")
    lines.append("")
    return lines
