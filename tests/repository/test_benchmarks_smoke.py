"""The benchmark harness in a tiny configuration, so it cannot rot: real worker processes, a real
gloo_cpu refit, the raw Gloo floor and the memcpy limit on an 8 MiB payload, one repetition.
Checks the results' schema and that a backend that fails is recorded, not fatal. No timing is
asserted beyond "positive"."""

from __future__ import annotations

import json
import operator
import os
import sys
from pathlib import Path

import pytest

# benchmarks/ is a top-level folder of the repository, not an installed package: importable
# under `python -m pytest` from the root, and under a bare `pytest` thanks to this line.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import Phase, run_phase  # noqa: E402
from benchmarks.methods import MemcpyMethod, RefitMethod, refit_phases  # noqa: E402
from benchmarks.report import SCHEMA  # noqa: E402
from benchmarks.run import _config, _parser, run, write_results  # noqa: E402
from benchmarks.weights import write_payload  # noqa: E402


def _log(message: str) -> None:
    print(message)


def test_tiny_run_writes_a_complete_report(tmp_path: Path) -> None:
    args = _parser().parse_args(
        [
            "--payloads",
            "8MiB",
            "--buckets",
            "4MiB",
            "--reps",
            "1",
            "--per-tensor-count",
            "0",
            "--methods",
            "gloo_paired,raw_paired,memcpy,memcpy_2proc",
            "--no-plot",
            "--out",
            str(tmp_path),
            "--timeout",
            "120",
        ]
    )
    config = _config(args)
    doc = run(config)
    written = write_results(doc, tmp_path, plot=False)

    loaded = json.loads((tmp_path / "benchmarks.json").read_text())
    assert loaded == json.loads(json.dumps(doc))
    assert {p.name for p in written} == {"benchmarks.json", "benchmarks.md"}
    assert loaded["schema"] == SCHEMA
    assert set(loaded) >= {"environment", "config", "memory_method", "payloads", "cases", "targets", "per_tensor"}
    assert loaded["config"]["reps"] == 1 and loaded["per_tensor"] is None
    (payload,) = loaded["payloads"]
    assert payload["label"] == "8 MiB" and payload["tensors"] > 2

    cases = {c["key"]: c for c in loaded["cases"]}
    assert set(cases) == {"gloo_paired", "raw_paired", "memcpy", "memcpy_2proc"}
    for case in cases.values():
        assert case["error"] is None, case["error"]
        assert case["group"] == "bucket 4 MiB" and case["payload"] == "8 MiB"
        assert case["reps"] == 1 and case["seconds"][0] > 0 and case["gbps"] > 0
        assert case["payload_bytes"] == payload["payload_bytes"]
        for worker in case["memory"]["workers"]:
            assert worker["rss_peak_bytes"] > 0 and worker["rss_base_bytes"] > 0

    refit = cases["gloo_paired"]
    assert refit["kind"] == "refit" and refit["shape"] == "1->1" and refit["bucket_size"] == 4 << 20
    assert refit["stats"]["sender"]["buckets"] >= 2 and refit["stats"]["receiver"]["buckets"] >= 2
    assert refit["ratios"]["raw_gloo"] > 0 and refit["ratios"]["memcpy"] > 0
    assert refit["ratios"]["copies_at_once"] > 0  # beside memcpy_2proc, its 1->1 ceiling
    assert refit["ratios"]["naive_torch"] is None  # not selected
    assert len(cases["memcpy_2proc"]["memory"]["workers"]) == 2
    assert refit["cpu_seconds"]["sender"] > 0 and refit["cpu_seconds"]["receiver"] > 0
    assert cases["memcpy"]["cpu_seconds"]["local"] > 0
    # The receiver holds the whole payload at its peak, so its peak is at least base + payload
    # minus nothing: a negative "over" figure would mean the bookkeeping is wrong.
    assert refit["memory"]["receiver_over_payload_bytes"] >= 0
    assert refit["memory"]["sender_over_weights_bytes"] >= 0

    by_target = {(t["id"], t["method"]): t for t in loaded["targets"]}
    assert by_target["gloo_vs_raw", "gloo_paired"]["met"] is None  # only buckets >= 64 MiB count
    assert by_target["sender_memory", "gloo_paired"]["met"] in (True, False)
    assert by_target["vs_naive", "gloo_paired"]["unmeasured"] == 1

    markdown = (tmp_path / "benchmarks.md").read_text()
    assert "## 8 MiB payload" in markdown and "gloo_cpu paired" in markdown and "## Targets" in markdown


def test_a_failing_backend_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    payload = write_payload(tmp_path / "payload", 1 << 20, label="1 MiB")
    broken = RefitMethod(
        key="broken",
        label="no such backend",
        backend="no_such_backend_for_bench",
        num_rollout=1,
        bucket_size=1 << 20,
        engine_kwargs={},
        topology="broadcast",
        timeout_s=60.0,
    )
    memcpy = MemcpyMethod(timeout_s=60.0)
    try:
        records = run_phase(Phase("bucket 1 MiB", [broken, memcpy], [payload], reps=2), _log)
    finally:
        broken.close()
        memcpy.close()
    by_key = {r.method["key"]: r for r in records}
    assert by_key["broken"].samples == [] and "no_such_backend_for_bench" in (by_key["broken"].error or "")
    assert by_key["memcpy"].error is None and len(by_key["memcpy"].samples) == 2


def test_the_producing_workload_runs_side_by_side(tmp_path: Path) -> None:
    """``python -m benchmarks.produce`` in a tiny configuration: every method runs on the
    produced payload, the refit of produced weights is verified bit-exact in its warm-up, and the
    ratios the performance issue sets are reported. One mode, cast-bf16 (the one whose payload
    differs from the ready weights'); the fill mode's producer is run by test_cli_bench.py."""
    from benchmarks.produce import main

    assert (
        main(
            [
                *("--size", "8MiB", "--bucket-size", "2MiB", "--reps", "1", "--modes", "cast-bf16"),
                *("--out", str(tmp_path), "--timeout", "120"),
            ]
        )
        == 0
    )
    results = json.loads((tmp_path / "produce.json").read_text())
    assert set(results["modes"]) == {"cast-bf16"}
    # producing alone gets the threads the refit's policy process has: half the cores
    assert results["produce_threads"] == max(1, (os.cpu_count() or 2) // 2)
    for mode, result in results["modes"].items():
        expected = {
            "produce",
            "produce_all_cores",
            "refit",
            "raw",
            "raw_beside_producing",
            "naive",
            "refit_ready",
            "refit_ready_beside_producing",
        }
        assert set(result["median_seconds"]) == expected, mode
        assert all(seconds > 0 for seconds in result["median_seconds"].values()), mode
        assert result["payload_bytes"] > 0 and result["speedup_over_naive"] > 0
        # the refit's phases, from its sender's bucket posts, add up to its end-to-end time
        phases = {key: values[0] for key, values in result["refit_phases_seconds"].items()}
        assert set(phases) == {"producing", "blocked", "after_last_post", "first_post"}, mode
        assert all(value >= 0 for value in phases.values()), (mode, phases)
        total = phases["producing"] + phases["blocked"] + phases["after_last_post"]
        assert total == pytest.approx(result["seconds"]["refit"][0], abs=1e-6), (mode, phases)
        assert phases["first_post"] <= phases["producing"] + phases["blocked"], (mode, phases)
        # what the machine allows: the refit's CPU time by process role, and two floors from it
        assert set(result["median_refit_cpu_seconds"]) == {"sender", "receiver"}, mode
        assert all(cpu > 0 for cpu in result["median_refit_cpu_seconds"].values()), mode
        floors = result["floor_seconds"]
        assert floors["producer_thread"] > result["median_seconds"]["produce"], (mode, floors)
        assert floors["cpu"] >= result["median_refit_phases_seconds"]["first_post"], (mode, floors)
        assert result["over_floor"] == pytest.approx(result["median_seconds"]["refit"] / max(floors.values()))
    # cast-bf16 turns the payload's fp32 norms into bf16: fewer bytes than the ready payload
    assert results["modes"]["cast-bf16"]["payload_bytes"] < results["modes"]["cast-bf16"]["ready_payload_bytes"]
    markdown = (tmp_path / "produce.md").read_text()
    assert "| cast-bf16 |" in markdown and f"What {results['cores']} cores allow" in markdown


def test_a_post_stamped_after_the_receivers_ended_ends_its_phases_there() -> None:
    """The sender stamps its last post when the post call returns, here 0.1 s after the last
    receiver held every tensor (the sender's thread resumed late): no phase is negative, and
    they still add up to the refit's time."""
    sender = {"started_at": 0.0, "ended_at": 1.0, "bucket_posts": [0.3, 0.9], "stats": {"transfer_seconds": 0.2}}
    phases = refit_phases(sender, ended_at=0.8)
    assert phases == pytest.approx({"producing": 0.8, "blocked": 0.0, "after_last_post": 0.0, "first_post": 0.3})


@pytest.mark.parametrize("topology", ["paired", "fanout"])
def test_the_sharded_refit_benchmark_runs_side_by_side(topology: str, tmp_path: Path) -> None:
    """``python -m benchmarks.sharded`` in a tiny configuration: both refits verified in their
    warm-up, each sharded rank received exactly its kept bytes, fewer than the full refit's."""
    from benchmarks.sharded import main

    tiny = ["--hidden", "64", "--intermediate", "32", "--experts", "4", "--layers", "1", "--vocab", "128"]
    args = [*tiny, "--bucket-size", "32KiB", "--reps", "1", "--topology", topology, "--out", str(tmp_path)]
    assert main(args) == 0
    results = json.loads((tmp_path / f"sharded_{topology}.json").read_text())
    assert results["summary"]["sharded"]["received_bytes_per_rank"] == results["kept_bytes_per_rank"]
    assert results["summary"]["full"]["received_bytes_per_rank"] == [results["model_bytes"]] * 2
    assert 0 < results["bytes_ratio"] < 1 and results["time_ratio"] > 0
    assert "| sharded |" in (tmp_path / f"sharded_{topology}.md").read_text()


def test_the_delta_refit_benchmark_runs_side_by_side(tmp_path: Path) -> None:
    """``python -m benchmarks.delta`` in a tiny configuration: the workload's fractions are
    measured, the kernels against a copy, and at each fraction asked a full and a delta refit
    with the floor beside them: at 1% the delta refit moves patches, at 50% every byte."""
    from benchmarks.delta import main

    args = [
        "--size",
        "4MiB",
        "--elements-per-tensor",
        "262144",
        "--reps",
        "1",
        "--settle",
        "1",
        "--fractions",
        "0.01",
        "0.5",
    ]
    args += ["--backends", "gloo_cpu", "--workload-hidden", "32", "--workload-layers", "1", "--workload-steps", "2"]
    assert main([*args, "--kernel-size", "256KiB", "--bucket-size", "1MiB", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "delta.json").read_text())
    (run,) = results["refits"]
    low, high = run["rows"]
    assert [low["fraction"], high["fraction"]] == [0.01, 0.5]
    assert low["full_payload_bytes"] == results["setup"]["size"] == 4 << 20
    assert 0.005 < low["changed_fraction"] < 0.015
    assert low["delta_payload_bytes"] < 0.05 * low["full_payload_bytes"]  # patches: 6 bytes a changed element
    assert high["delta_payload_bytes"] >= high["full_payload_bytes"]  # half changed: whole again
    assert low["floor_seconds"] > 0 and low["delta_over_floor"] > 0
    assert all(high["lifetime_peak_rss_bytes"][mode] > 0 for mode in ("full", "delta"))
    assert all(0 < f < 1 for row in results["workload"] for f in row["changed_fraction_per_step"])
    assert results["kernels"]["diff_ratio_to_copy"] > 0 and results["kernels"]["apply_ratio_to_copy"] > 0
    table = (tmp_path / "delta.md").read_text()
    (settling,) = run["settling"]  # a round at the first fraction, apart from the medians
    assert settling["fraction"] == 0.01 and settling["choice"]["patched_tensors"] > 0
    assert "## Refits: gloo_cpu" in table and "## Goals" in table and "While the choice settled" in table


def test_a_revision_is_measured_beside_this_tree(tmp_path: Path) -> None:
    """``python -m benchmarks.against HEAD`` in a tiny configuration: both trees run, alternately,
    and every case measured by both is in the comparison, with its figures from each."""
    from benchmarks.against import main

    options = ["--payloads", "4MiB", "--buckets", "1MiB", "--reps", "1", "--methods", "gloo_paired,raw_paired"]
    assert main(["HEAD", "--runs", "1", "--out", str(tmp_path), "--", *options]) == 0
    result = json.loads((tmp_path / "against.json").read_text())
    (old,) = [row for row in result["old"] if row["case"] == "gloo_paired"]
    (new,) = [row for row in result["new"] if row["case"] == "gloo_paired"]
    assert old["gbps"] > 0 and new["gbps"] > 0 and old["x_raw"] > 0 and new["x_raw"] > 0
    assert "| gloo_paired | 4 MiB | 1 |" in (tmp_path / "against.md").read_text()


def test_the_small_refit_benchmark_runs_beside_its_floors(tmp_path: Path) -> None:
    """``python -m benchmarks.small_refit`` in a tiny configuration: per backend, refits, the
    transport's floor (its bytes and a round trip) and that floor with the async API's
    hand-offs, refits through the blocking calls and with borrowed tensors, as many of each
    (they alternate), each positive; when each receive returned; and the CPU time each side's
    process spent on each refit and floor."""
    from benchmarks.small_refit import main

    args = ["--size", "400KB", "--tensors", "8", "--reps", "3", "--out", str(tmp_path)]
    assert main(args) == 0
    results = json.loads((tmp_path / "small_refit.json").read_text())
    assert [measured["backend"] for measured in results["runs"]] == ["cuda_ipc", "gloo_cpu"]
    for measured in results["runs"]:
        samples = (
            "refit_seconds",
            "received_seconds",
            "floor_seconds",
            "floor_with_hand_offs_seconds",
            "blocking_refit_seconds",
            "borrowed_refit_seconds",
            "borrowed_blocking_refit_seconds",
        )
        assert [len(measured[key]) for key in samples] == [3] * 7
        assert all(0 < seconds < 1.0 for key in samples for seconds in measured[key])
        assert 0 < measured["floor_median_s"] and 0 < measured["floor_with_hand_offs_median_s"]
        assert 0 < measured["refit_median_s"] < 1.0 and 0 < measured["blocking_refit_median_s"] < 1.0
        # the receive returns after its last batch was taken
        assert all(map(operator.le, measured["refit_seconds"], measured["received_seconds"]))
        cpu = measured["cpu_seconds"]
        assert sorted(cpu) == ["floor_receiver", "floor_sender", "policy", "rollout"]
        assert all(len(values) == 3 and all(0 < value < 1.0 for value in values) for values in cpu.values()), cpu
    report = (tmp_path / "small_refit.md").read_text()
    assert "| gloo_cpu |" in report and "| backend | refit: policy | rollout | both | wall |" in report
    assert "| backend | refit, borrowed | / floor |" in report


def test_the_verl_sync_benchmark_times_each_part_of_a_sync(tmp_path: Path) -> None:
    """``python -m benchmarks.verl_sync`` in a tiny configuration: per backend, each sync's parts
    (rebuild and transfer within the whole), and what each of verl's own engines answers."""
    pytest.importorskip("verl", reason="verl is not installed (the dev set-up pins verl==0.9.1)")
    from benchmarks.verl_sync import main

    assert main(["--size", "1MiB", "--tensors", "4", "--syncs", "2", "--rollouts", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "verl_sync.json").read_text())
    assert [measured["backend"] for measured in results["runs"]] == ["cuda_ipc", "gloo_cpu"]
    for measured in results["runs"]:
        assert len(measured["runs"]) == 2
        for sync in measured["runs"]:
            assert (
                0 < sync["transfer_s"]
                and 0 < sync["rebuild_s"]
                and sync["rebuild_s"] + sync["transfer_s"] <= sync["sync_s"]
            )
        assert measured["verls_own"]["naive"].startswith("NotImplementedError"), measured["verls_own"]
        assert "nccl_checkpoint_engine" in measured["verls_own"], measured["verls_own"]  # needs cupy (CUDA)
    assert "| ckpt_gloo_cpu |" in (tmp_path / "verl_sync.md").read_text()


def test_the_slow_link_benchmark_refuses_to_run_without_its_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where ``ip`` or ``tc`` is missing, ``python -m benchmarks.slow_link`` says which and
    exits with status 2, having made nothing."""
    from benchmarks.slow_link import main

    monkeypatch.setenv("PATH", str(tmp_path))  # neither ip nor tc there
    assert main(["--out", str(tmp_path / "out")]) == 2
    assert "cannot run here: 'ip' (iproute2) is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
