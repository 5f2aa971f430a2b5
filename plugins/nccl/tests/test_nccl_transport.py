"""The nccl transport's pieces in one process: checksum verification as payloads land, the
payload group's send/recv mapping, and which workers share a link."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from ckpt_core.device_checksum import device_payload_checksum
from ckpt_core.errors import EngineOptionError, IntegrityError, WireFormatError
from ckpt_core.transport import BucketReceiver
from ckpt_core.wire import BucketHeader, encode_header
from ckpt_nccl.transport import NcclReceiver, PayloadGroup, check_distinct_gpus, link_members


class ScriptedReceiver(BucketReceiver):
    """Hands out prepared headers and payloads in order, as a transport would deliver them."""

    def __init__(self, deliveries: list[tuple[bytes, torch.Tensor]]) -> None:
        self.deliveries = list(deliveries)
        self.buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(self.num_slots)]
        self.pending: torch.Tensor | None = None
        self.closed = False

    def buffer(self, slot: int) -> torch.Tensor:
        return self.buffers[slot]

    def recv_header(self, timeout_s: float) -> bytes:
        header, self.pending = self.deliveries.pop(0)
        return header

    def post_payload(self, slot: int, nbytes: int, timeout_s: float) -> None:
        assert self.pending is not None
        self.buffers[slot][:nbytes] = self.pending[:nbytes]

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _delivery(bucket: int, payload: torch.Tensor, digest: int | None) -> tuple[bytes, torch.Tensor]:
    header = BucketHeader(refit_index=4, bucket_index=bucket, payload_nbytes=payload.numel(), last=False, checksum=digest)
    return encode_header(header), payload


def _receive(receiver: NcclReceiver, slot: int) -> torch.Tensor:
    receiver.recv_header(1.0)
    nbytes = receiver.inner.pending.numel()  # type: ignore[attr-defined]
    receiver.post_payload(slot, nbytes, 1.0)
    receiver.wait_payload(slot, 1.0)
    return receiver.buffer(slot)[:nbytes]


def test_intact_payloads_pass_and_a_corrupt_one_is_refused_with_its_bucket():
    good = torch.arange(40, dtype=torch.uint8)
    corrupt = good.clone()
    corrupt[17] ^= 4
    receiver = NcclReceiver(
        ScriptedReceiver([_delivery(0, good, device_payload_checksum(good)), _delivery(1, corrupt, device_payload_checksum(good))]),
        device_payload_checksum,
    )
    assert torch.equal(_receive(receiver, 0), good)
    with pytest.raises(IntegrityError, match=r"bucket 1 of refit 4 is corrupt: device payload checksum"):
        _receive(receiver, 1)


def test_no_verification_without_a_header_checksum_or_with_checksums_off():
    payload = torch.arange(10, dtype=torch.uint8)
    wrong = device_payload_checksum(payload) ^ 1
    unchecked = NcclReceiver(ScriptedReceiver([_delivery(0, payload, wrong)]), None)
    assert torch.equal(_receive(unchecked, 0), payload)
    no_digest = NcclReceiver(ScriptedReceiver([_delivery(0, payload, None)]), device_payload_checksum)
    assert torch.equal(_receive(no_digest, 0), payload)


def test_a_header_the_pipeline_will_refuse_is_not_verified_here():
    payload = torch.arange(8, dtype=torch.uint8)
    receiver = NcclReceiver(ScriptedReceiver([(b"{not json", payload)]), device_payload_checksum)
    _receive(receiver, 0)  # the pipeline's decode_header raises WireFormatError for it


def test_close_reaches_the_wrapped_receiver():
    inner = ScriptedReceiver([])
    NcclReceiver(inner, device_payload_checksum).close()
    assert inner.closed


def _solo_group() -> PayloadGroup:
    store = dist.HashStore()
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=10)
    return PayloadGroup(dist.ProcessGroupGloo(store, 0, 1, options))


def test_payload_group_broadcasts_and_refuses_send_recv_outside_a_pair():
    group = _solo_group()
    tensor = torch.arange(5)
    group.broadcast(tensor, 0).wait(datetime.timedelta(seconds=10))
    assert torch.equal(tensor, torch.arange(5))
    with pytest.raises(ValueError, match="needs a pair"):
        group.send([tensor], 1, 3)
    with pytest.raises(ValueError, match="needs a pair"):
        group.recv([tensor], 0, 3)
    group.shutdown()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("topology", "role", "rank", "members"),
    [
        ("broadcast", "policy", 0, [0, 3, 4]),
        ("broadcast", "policy", 2, []),
        ("broadcast", "rollout", 1, [0, 3, 4]),
        ("paired", "policy", 1, [1, 4]),
        ("paired", "policy", 2, []),
        ("paired", "rollout", 0, [0, 3]),
    ],
)
def test_link_members(topology, role, rank, members):
    assert link_members(topology, role, rank, train_world_size=3, rollout_world_size=2) == members


def test_distinct_gpus_pass_and_a_shared_gpu_names_both_workers():
    metadata = [{"gpu_uuid": "GPU-a", "device": "cuda:0"}, {"gpu_uuid": "GPU-b"}, {"gpu_uuid": "GPU-a", "device": "cuda:0"}]
    check_distinct_gpus("E", metadata, [0, 1], train_world_size=2)
    with pytest.raises(EngineOptionError, match=r"policy rank 0 and rollout rank 0 are on the same GPU \(GPU-a"):
        check_distinct_gpus("E", metadata, [0, 1, 2], train_world_size=2)
    with pytest.raises(WireFormatError, match=r"metadata\[1\] has no 'gpu_uuid'"):
        check_distinct_gpus("E", [{"gpu_uuid": "x"}, {}], [0, 1], train_world_size=1)
