"""A RefitWorker whose process may own a default process group, as a trainer's would."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from ckpt_core.orchestration.worker import RefitWorker


class DefaultGroupWorker(RefitWorker):
    def __init__(self, *, with_default_group: bool, **kwargs: Any) -> None:
        if with_default_group:
            # A store on a port it binds itself: no window for another process to take it.
            store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            self._world = dist.group.WORLD
        super().__init__(**kwargs)

    def default_group_state(self) -> dict[str, Any]:
        if not dist.is_initialized():
            return {"initialized": False}
        assert dist.group.WORLD is self._world, "the default group object was replaced"
        return {"initialized": True, "world_size": dist.get_world_size(), "backend": dist.get_backend()}
