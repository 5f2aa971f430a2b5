"""What ``BucketedEngine`` requires of a transport is enforced where it is declared: the two
connect methods are abstract, a concrete engine without a ``backend_name`` is refused when its
class is defined, and a transport's metadata cannot overwrite the engine's own keys."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_core.errors import NotAnEngineError, WireFormatError
from ckpt_core.registry import resolve_backend
from ckpt_core.transport import BucketedEngine, BucketReceiver, BucketSender


class _ConnectsNowhere:
    """Both connect methods, for engines that are never connected in these tests."""

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | None:
        return None

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        raise NotImplementedError("never connected in these tests")


class ForgetsToConnectRollouts(BucketedEngine):
    backend_name = "forgets"

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | None:
        return None


def test_a_transport_without_connect_rollout_is_abstract() -> None:
    with pytest.raises(TypeError, match="_connect_rollout"):
        ForgetsToConnectRollouts(bucket_size=1024)  # type: ignore[abstract]
    with pytest.raises(NotAnEngineError, match="is abstract; it lacks _connect_rollout"):
        resolve_backend(f"{__name__}:ForgetsToConnectRollouts")


def test_a_concrete_transport_must_name_its_backend() -> None:
    with pytest.raises(TypeError, match="must set backend_name"):

        class Nameless(_ConnectsNowhere, BucketedEngine):
            pass


def test_an_abstract_intermediate_base_needs_no_name() -> None:
    class HalfWay(BucketedEngine):  # still abstract: no name needed yet
        pass

    class Done(_ConnectsNowhere, HalfWay):
        backend_name = "done"

    assert Done(bucket_size=1024).backend_name == "done"


class ClaimsTheEngineId(_ConnectsNowhere, BucketedEngine):
    backend_name = "claims"

    def _prepare_transport(self) -> dict[str, Any]:
        return {"engine_id": "mine", "port": 1}


def test_a_transport_cannot_overwrite_the_engines_own_metadata() -> None:
    engine = ClaimsTheEngineId(bucket_size=1024)
    with pytest.raises(WireFormatError, match=r"returned the keys \['engine_id'\]"):
        engine.prepare()
