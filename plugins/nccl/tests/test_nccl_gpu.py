"""GPU checks of the nccl backend (``pytest -m gpu``; run by scripts/gpu_check.sh).

One GPU cannot hold two ranks of one NCCL communicator, so a one-GPU machine checks what a
single rank can: a one-rank NCCL group on a TCPStore, packing on the side stream, the
device checksum against the host's, the sender's whole pipeline into a one-rank link, and
the engine's GPU-side setup, and what the engine does to its process (NCCL's error mode set
once, the closed rendezvous quiet) in a process of its own. The conformance kit between
processes, which needs a GPU per rank, is in test_nccl_conformance.py.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckpt_core._internal.device_checksum import device_payload_checksum
from ckpt_core.chunking import split_weight_chunks, tensor_bytes
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import EngineOptionError
from ckpt_core.testing.weights import every_dtype
from ckpt_nccl import NcclCheckpointEngine
from ckpt_nccl.cuda import CLEAN_UP_ONLY, ERROR_HANDLING_ENV, CudaPackStream, CudaPlatform
from ckpt_nccl.transport import NcclSender, PayloadGroup

REASON = CudaPlatform().unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"needs CUDA and NCCL: {REASON}")]
GPU_COUNT = torch.cuda.device_count() if REASON is None else 0
TIMEOUT = datetime.timedelta(seconds=60)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, wait_for_workers=False)


def test_a_one_rank_nccl_group_on_a_tcpstore_broadcasts_without_a_default_group():
    device = torch.device("cuda", 0)
    backend = CudaPlatform().new_group(dist.PrefixStore("solo/", _store()), 0, 1, device=device, timeout_s=60.0)
    group = PayloadGroup(backend)
    try:
        tensor = torch.arange(4096, dtype=torch.float32, device=device)
        group.broadcast(tensor, 0).wait(TIMEOUT)
        assert torch.equal(tensor.cpu(), torch.arange(4096, dtype=torch.float32))
        assert not dist.is_initialized()
    finally:
        group.shutdown()


def test_packing_on_the_side_stream_waits_for_the_callers_work_and_keeps_the_chunk_alive():
    device = torch.device("cuda", 0)
    stream = CudaPackStream(device)
    count = 1 << 22
    target = torch.empty(count * 4, dtype=torch.uint8, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    for round_ in range(3):
        want = torch.randn(count, generator=generator, device=device)
        torch.cuda._sleep(20_000_000)  # keep the caller's stream busy: an unordered copy would win the race
        chunk = (want * (round_ + 2)).view(torch.uint8)  # queued behind the sleep
        stream.pack(target, chunk)
        del chunk  # the caller frees it at once; its memory must not be reused before the copy
        torch.full((count,), -1.0, device=device)
        torch.cuda.synchronize(device)
        assert torch.equal(target.view(torch.float32), want * (round_ + 2)), f"round {round_}"


@pytest.mark.parametrize("nbytes", [0, 5, 8 * 4096, 3 * 8 * 4096 + 8 * 7 + 3, 64 << 20])
def test_the_device_checksum_on_the_gpu_equals_the_host_one(nbytes):
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert device_payload_checksum(host.to("cuda:0")) == device_payload_checksum(host)


def _weights_on_gpu(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Every dtype (bytes moved, not values: some dtypes have no CUDA copy kernel), then a
    tensor spanning three buckets, whose full-bucket chunks are sent from the tensor itself."""
    weights = [
        (name, tensor_bytes(tensor).to(device).view(tensor.dtype).reshape(tensor.shape))
        for name, tensor in every_dtype({"seed": 3}, refit_index=0, rank=0)
    ]
    weights.append(("spans_buckets", torch.randn(3 * (1 << 14) + 5, device=device)))
    return weights


def test_the_sender_pipeline_packs_checksums_and_sends_into_a_one_rank_link():
    """send_refit through NcclSender into a one-member link: packing, sending straight from a
    tensor, the device checksum on the pack stream and the NCCL broadcast under it all run;
    every bucket's bytes are where the chunk layout says."""
    from ckpt_core._internal.send import direct_min_bytes, send_refit
    from ckpt_core.hooks import RefitNotifier
    from ckpt_core.transport.torch_distributed import Link

    device = torch.device("cuda", 0)
    bucket_size = 1 << 16
    platform = CudaPlatform()
    store = _store()
    control_options = dist.ProcessGroupGloo._Options()
    control_options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    control_options._timeout = TIMEOUT
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), 0, 1, control_options)
    data = PayloadGroup(platform.new_group(dist.PrefixStore("data/", store), 0, 1, device=device, timeout_s=60.0))
    link = Link(control, data, rank=0, size=1, broadcast=True, peer="nobody")
    stream = platform.new_pack_stream(device)
    sender = NcclSender(link, bucket_size, device, stream)
    assert sender.direct_chunks
    weights = _weights_on_gpu(device)
    parts: list[torch.Tensor] = []

    def checksum(payload: torch.Tensor) -> int:  # the engine's, plus a copy of each bucket part
        stream.follow_caller()
        with stream.active():
            parts.append(payload.clone())
            return device_payload_checksum(payload)

    notifier = RefitNotifier("nccl", "policy", 0)
    try:
        stats = send_refit(
            iter(weights),
            sender,
            bucket_size=bucket_size,
            context=notifier.context(0),
            notifier=notifier,
            timeout_s=60.0,
            checksum=checksum,
        )
        # Each bucket's parts, as checksummed: its packed slot bytes (chunks closed up at
        # aligned offsets), then its direct chunks, sent from the tensors themselves.
        layout: list[list[tuple[TensorMeta, torch.Tensor]]] = [[]]
        layout_end = 0
        for meta, chunk in split_weight_chunks(iter(weights), bucket_size):
            if meta.offset < layout_end:  # the layout's rule for "this chunk opens the next bucket"
                layout.append([])
            layout_end = meta.offset + meta.chunk_size
            layout[-1].append((meta, chunk))
        assert stats.tensors == len(weights) and stats.buckets == len(layout) >= 4
        remaining = iter(parts)
        direct_min = direct_min_bytes(bucket_size)
        for bucket in layout:
            packed, end = next(remaining), 0
            for meta, chunk in bucket:
                if meta.chunk_size >= direct_min:
                    assert torch.equal(next(remaining), chunk), (meta.name, meta.chunk_offset)
                    continue
                start = -(-end // meta.dtype.itemsize) * meta.dtype.itemsize
                end = start + meta.chunk_size
                assert torch.equal(packed[start:end], chunk), (meta.name, meta.chunk_offset)
            assert packed.numel() == end
        assert next(remaining, None) is None
    finally:
        sender.close()
        data.shutdown()
        control.shutdown()


def test_prepare_on_a_gpu_returns_json_metadata_naming_the_gpu():
    engine = NcclCheckpointEngine(bucket_size=1 << 20, device="cuda:0", release_after_refit=True)
    try:
        metadata = engine.prepare()
        assert json.loads(json.dumps(metadata)) == metadata
        assert metadata["device"] == "cuda:0"
        assert metadata["gpu_uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    finally:
        engine.finalize()


def test_the_default_device_is_the_current_one_and_a_missing_index_is_refused():
    assert NcclCheckpointEngine(bucket_size=1024).device == torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(EngineOptionError, match=f"device 'cuda:{GPU_COUNT}' does not exist"):
        NcclCheckpointEngine(bucket_size=1024, device=f"cuda:{GPU_COUNT}")


def test_two_ranks_on_one_gpu_are_refused_before_nccl_sees_them():
    policy = NcclCheckpointEngine(bucket_size=1 << 16, device="cuda:0")
    rollout = NcclCheckpointEngine(bucket_size=1 << 16, device="cuda:0")
    try:
        metadata = [policy.prepare(), rollout.prepare()]
        with pytest.raises(EngineOptionError, match="are on the same GPU"):
            policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
    finally:
        policy.finalize()
        rollout.finalize()


def test_the_error_mode_is_set_once_and_the_closed_rendezvous_answers_nccls_monitor_quietly():
    """In a fresh process (nccl_gpu_process.py), whose first NCCL group is the one polled:
    constructing the engine sets CleanUpOnly mode, building a group writes no environment, and
    once the rendezvous is detached NCCL's heartbeat monitor keeps asking the group's detached
    store for a dump signal without a single logged error (on the bare rendezvous store it
    logged one per poll)."""
    env = {key: value for key, value in os.environ.items() if key != ERROR_HANDLING_ENV}
    # The monitor and its dump signal, made explicit, and a poll every 100 ms instead of every second.
    env.update(
        TORCH_NCCL_ENABLE_MONITORING="1",
        TORCH_NCCL_DUMP_ON_TIMEOUT="1",
        TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
        TORCH_NCCL_COORD_CHECK_MILSEC="100",
    )
    script = Path(__file__).resolve().parent / "nccl_gpu_process.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["env_at_start"] is None and report["env_after_engine"] == CLEAN_UP_ONLY, report
    assert report["group_wrote_environment"] is False and report["moved"] is True, report
    noise = [line for line in done.stderr.splitlines() if "should dump" in line.lower() or "was closed" in line]
    assert not noise, noise[:5]
    assert report["checks_after_detach"], (
        "NCCL's heartbeat monitor never asked the detached store in 2 s at a 100 ms interval, so this test "
        f"saw nothing to check (torch {torch.__version__}); report {report}; stderr {done.stderr[-2000:]}"
    )
