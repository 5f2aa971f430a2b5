"""The metadata rendezvous: workers that no orchestrator sits between (vLLM's inference
workers, a trainer) exchange their ``prepare()`` entries through a store one process serves."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ckpt_core.errors import InvalidArgumentError, PeerLostError, TransferTimeoutError, WireFormatError
from ckpt_core.orchestration.rendezvous import MetadataRendezvous, exchange_metadata


def _exchange_all(
    address: str, entries: dict[tuple[str, int], Any], sizes: tuple[int, int], timeout_s: float = 10.0
) -> dict[Any, Any]:
    """Each entry's worker exchanges on a thread of its own; each one's list or error."""
    results: dict[Any, Any] = {}

    def one(role: str, rank: int, entry: Any) -> None:
        try:
            results[(role, rank)] = exchange_metadata(
                address,
                role=role,  # type: ignore[arg-type]
                rank=rank,
                entry=entry,
                train_world_size=sizes[0],
                rollout_world_size=sizes[1],
                timeout_s=timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[(role, rank)] = exc

    threads = [threading.Thread(target=one, args=(*key, entry)) for key, entry in entries.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_every_worker_gets_every_entry_policy_first_in_rank_order() -> None:
    entries = {
        ("rollout", 1): {"host": "r1", "weight_layout": {"a": [1, 2]}},
        ("policy", 1): {"host": "p1"},
        ("rollout", 0): {"host": "r0"},
        ("policy", 0): {"host": "p0", "port": 5},
    }
    with MetadataRendezvous() as rendezvous:
        results = _exchange_all(rendezvous.address, entries, (2, 2))
        rendezvous.wait_until_read(4, timeout_s=5)
    expected = [entries[("policy", 0)], entries[("policy", 1)], entries[("rollout", 0)], entries[("rollout", 1)]]
    assert results == {key: expected for key in entries}


def test_a_worker_that_never_comes_is_named_within_the_deadline() -> None:
    with MetadataRendezvous() as rendezvous:
        started = time.monotonic()
        results = _exchange_all(rendezvous.address, {("policy", 0): {}, ("rollout", 0): {}}, (1, 2), timeout_s=1.0)
        elapsed = time.monotonic() - started
    for who, error in results.items():
        assert isinstance(error, TransferTimeoutError), (who, error)
        assert "1 worker(s) did not join" in str(error) and str(error).endswith("within 1s: rollout rank 1")
    assert elapsed < 10


def test_a_rank_taken_twice_is_refused() -> None:
    with MetadataRendezvous(timeout_s=5) as rendezvous:
        results = _exchange_all(rendezvous.address, {("policy", 0): {"first": 1}}, (1, 1), timeout_s=2.0)
        assert isinstance(results[("policy", 0)], TransferTimeoutError)  # the rollout never came
        with pytest.raises(WireFormatError, match="policy rank 0 joined.*another worker already took that rank"):
            exchange_metadata(
                rendezvous.address,
                role="policy",
                rank=0,
                entry={"second": 2},
                train_world_size=1,
                rollout_world_size=1,
                timeout_s=2.0,
            )


def test_no_rendezvous_at_the_address_is_a_peer_lost_error_within_the_deadline() -> None:
    with MetadataRendezvous() as rendezvous:
        address = rendezvous.address
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="metadata rendezvous"):
        exchange_metadata(
            address, role="policy", rank=0, entry={}, train_world_size=1, rollout_world_size=1, timeout_s=1.0
        )
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"address": "nohost"}, "address must be 'host:port', got 'nohost'"),
        ({"address": "h:99999"}, "address must be 'host:port'"),
        ({"role": "trainer"}, "role must be 'policy' or 'rollout', got 'trainer'"),
        ({"rank": 1}, r"policy rank must be an int in \[0, 1\), got 1"),
        ({"train_world_size": 0}, "train_world_size must be an int >= 1, got 0"),
        ({"entry": {"x": b"bytes"}}, r"policy rank 0's entry is not plain JSON data: \['x'\] is a bytes"),
        ({"timeout_s": 0}, "timeout_s must be a finite number > 0, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_connecting(change: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {
        "address": "127.0.0.1:1",
        "role": "policy",
        "rank": 0,
        "entry": {},
        "train_world_size": 1,
        "rollout_world_size": 1,
        "timeout_s": 1.0,
        **change,
    }
    with pytest.raises(InvalidArgumentError, match=message):
        exchange_metadata(kwargs.pop("address"), **kwargs)
