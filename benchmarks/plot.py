"""The throughput plot: GB/s against bucket size, one panel per payload, one line per method,
the single-thread memcpy limit as a horizontal line."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .report import PER_TENSOR_GROUP
from .units import format_size

_STYLE = {
    "gloo_paired": {"color": "tab:blue", "marker": "o", "linestyle": "-"},
    "gloo_paired_checksum": {"color": "tab:blue", "marker": "o", "linestyle": ":"},
    "gloo_broadcast": {"color": "tab:cyan", "marker": "s", "linestyle": "-"},
    "ipc_1to1": {"color": "tab:red", "marker": "o", "linestyle": "-"},
    "ipc_1to2": {"color": "tab:orange", "marker": "s", "linestyle": "-"},
    "raw_paired": {"color": "tab:blue", "marker": "x", "linestyle": "--"},
    "raw_broadcast": {"color": "tab:cyan", "marker": "x", "linestyle": "--"},
    "raw_paired_pieces": {"color": "tab:purple", "marker": "+", "linestyle": ":"},
    "memcpy_2proc": {"color": "black", "marker": "", "linestyle": ":"},
    "memcpy_3proc": {"color": "dimgray", "marker": "", "linestyle": ":"},
    "naive_torch_1to1": {"color": "tab:gray", "marker": "v", "linestyle": "-."},
    "naive_torch_1to2": {"color": "dimgray", "marker": "^", "linestyle": "-."},
    "naive_safetensors_1to1": {"color": "tab:brown", "marker": "d", "linestyle": "-."},
}


def plot_throughput(doc: dict[str, Any], path: Path) -> None:
    """Write the PNG; baselines measured beside each bucket size are drawn at that size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in doc["cases"] if c["group"] != PER_TENSOR_GROUP]
    payloads = [p["label"] for p in doc["payloads"]]
    buckets = sorted({c["bucket_size"] for c in cases if c["kind"] == "refit" and c["bucket_size"]})
    groups = {f"bucket {format_size(b)}": b for b in buckets}
    fig, axes = plt.subplots(
        1, len(payloads), figsize=(max(11.0, 6.5 * len(payloads)), 6.0), squeeze=False, sharey=True
    )
    handles: dict[str, Any] = {}
    top = 0.0
    for ax, payload in zip(axes[0], payloads):
        mine = [c for c in cases if c["payload"] == payload]
        keys = list(dict.fromkeys(c["key"] for c in mine if c["key"] != "memcpy"))
        for key in keys:
            points = []
            for c in mine:
                if c["key"] != key or c["gbps"] is None:
                    continue
                x = c["bucket_size"] if c["kind"] == "refit" or key == "raw_paired_pieces" else groups.get(c["group"])
                if x:
                    points.append((x, c["gbps"]))
            if not points:
                continue
            points.sort()
            first = next(c for c in mine if c["key"] == key)
            label = f"{first['label']} {first['shape']}"
            (line,) = ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                label=label,
                linewidth=2.2 if key in ("gloo_paired", "gloo_broadcast", "ipc_1to1", "ipc_1to2") else 1.2,
                **_STYLE.get(key, {}),
            )
            handles.setdefault(label, line)
            top = max(top, max(p[1] for p in points))
        memcpy = [c["gbps"] for c in mine if c["key"] == "memcpy" and c["gbps"] is not None]
        if memcpy:
            label = "memcpy, 1 thread (memory limit)"
            limit = statistics.median(memcpy)
            line = ax.axhline(limit, color="black", linewidth=1.5, label=label)
            ax.annotate(
                f"memcpy limit {limit:.2f} GB/s",
                (0.99, limit),
                xycoords=("axes fraction", "data"),
                ha="right",
                va="bottom",
                fontsize=8.5,
            )
            handles.setdefault(label, line)
            top = max(top, limit)
        ax.set_xscale("log", base=2)
        ax.set_xticks(buckets or [1])
        ax.set_xticklabels([format_size(b) for b in buckets] or [""])
        ax.minorticks_off()
        ax.set_xlabel("bucket size")
        ax.set_title(f"{payload} payload")
        ax.grid(True, alpha=0.3)
    for ax in axes[0]:
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
    axes[0][0].set_ylabel("throughput, GB/s (median, end to end)")
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=3, fontsize=8.5, frameon=False)
    fig.suptitle("ckpt-engine refit throughput vs. baselines (same run, round-robin)")
    fig.tight_layout(rect=(0, 0.17, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
