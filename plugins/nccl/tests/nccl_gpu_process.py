"""Run by test_nccl_gpu.py in a fresh process (``python nccl_gpu_process.py``), where its NCCL
group is the process's first, the one whose heartbeat monitor polls its store.

It builds an engine, then a one-rank NCCL group the way the engine does (on the link's
prefixed stores over the core's detachable rendezvous store), moves a tensor, detaches the
rendezvous as the core does once every group formed, and idles while NCCL's monitor polls.
Prints one JSON line: the error-mode variable at each step, whether building the group wrote
the environment, how often the detached rendezvous store answered the monitor, and whether the tensor moved.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from ckpt_core._internal.store import DetachableStore
from ckpt_nccl import NcclCheckpointEngine
from ckpt_nccl.cuda import ERROR_HANDLING_ENV, CudaPlatform
from ckpt_nccl.transport import PayloadGroup

IDLE_S = 2.0
TIMEOUT = datetime.timedelta(seconds=60)


def main() -> None:
    report: dict[str, object] = {"env_at_start": os.environ.get(ERROR_HANDLING_ENV)}
    engine = NcclCheckpointEngine(bucket_size=1 << 16, device="cuda:0")
    report["env_after_engine"] = os.environ.get(ERROR_HANDLING_ENV)
    rendezvous = DetachableStore(dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, wait_for_workers=False))
    link = dist.PrefixStore("data/", dist.PrefixStore("broadcast/", dist.PrefixStore("ckpt_core/t/", rendezvous)))
    before = dict(os.environ)
    backend = CudaPlatform().new_group(link, 0, 1, device=torch.device("cuda", 0), timeout_s=60.0)
    report["group_wrote_environment"] = dict(os.environ) != before
    group = PayloadGroup(backend)
    tensor = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
    group.broadcast(tensor, 0).wait(TIMEOUT)
    report["moved"] = bool(torch.equal(tensor.cpu(), torch.arange(1 << 16, dtype=torch.float32)))
    rendezvous.detach()
    time.sleep(IDLE_S)
    report["checks_after_detach"] = rendezvous.checks_after_detach
    group.shutdown()
    engine.finalize()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
