"""What the nccl engine does to its process, checked on the host: NCCL's error mode put in the
environment once, before any group exists, and the payload group's store quiet once the
rendezvous closed (test_nccl_gpu.py checks both against a real ProcessGroupNCCL)."""

from __future__ import annotations

import datetime
import logging
import os

import pytest
import torch.distributed as dist
from nccl_host_platform import HostNcclEngine

from ckpt_core._internal.store import DetachableStore
from ckpt_nccl.cuda import CLEAN_UP_ONLY, ERROR_HANDLING_ENV


def test_constructing_an_engine_sets_the_error_mode_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERROR_HANDLING_ENV, raising=False)
    engine = HostNcclEngine(bucket_size=1 << 16)
    try:
        assert os.environ.get(ERROR_HANDLING_ENV) == CLEAN_UP_ONLY
        engine.prepare()  # nothing more is written: prepare() builds no group
        assert os.environ.get(ERROR_HANDLING_ENV) == CLEAN_UP_ONLY
    finally:
        engine.finalize()


def test_a_value_set_before_is_replaced_once_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ERROR_HANDLING_ENV, "1")  # what torchrun gives its workers
    with caplog.at_level(logging.WARNING, logger="ckpt_nccl.cuda"):
        HostNcclEngine(bucket_size=1 << 16).finalize()
        HostNcclEngine(bucket_size=1 << 16).finalize()
    assert os.environ[ERROR_HANDLING_ENV] == CLEAN_UP_ONLY
    warnings = [r.getMessage() for r in caplog.records if ERROR_HANDLING_ENV in r.getMessage()]
    assert len(warnings) == 1 and "it was '1'" in warnings[0], warnings


def test_the_closed_rendezvous_answers_the_dump_poll_itself() -> None:
    """As the engine builds a payload group: on the link's prefixed stores over the core's
    detachable rendezvous store. After the rendezvous is detached (the core closes it once the
    groups formed), NCCL's heartbeat monitor still asks its group's store, from C++, whether a
    dump was requested; the detached store answers no instead of failing (NCCL logs each
    failure), and anything else still fails, saying why."""
    hashes = dist.HashStore()
    hashes.set_timeout(datetime.timedelta(seconds=5))  # a get of a missing key fails, not hangs
    rendezvous = DetachableStore(hashes)
    link = dist.PrefixStore("data/", dist.PrefixStore("broadcast/", dist.PrefixStore("ckpt_core/x/", rendezvous)))
    from_cpp = dist.PrefixStore("nccl", link)  # calls into the Python store as ProcessGroupNCCL does
    from_cpp.set("0", "unique id")
    assert from_cpp.get("0") == b"unique id"
    assert from_cpp.check(["0"]) and not from_cpp.check(["exception_dump"])
    rendezvous.detach()
    assert not from_cpp.check(["exception_dump"]) and not link.check(["exception_dump"])
    assert rendezvous.checks_after_detach == 2
    with pytest.raises(RuntimeError, match="rendezvous store was closed after the groups formed"):
        from_cpp.get("0")
    with pytest.raises(RuntimeError, match="closed"):
        from_cpp.set("1", "another communicator")
