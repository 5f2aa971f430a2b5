"""The address a worker binds and advertises when its ``host`` option is ``"auto"``.

An orchestrator that hands every worker the same options (NeMo RL does) cannot name each
node's address; ``"auto"`` lets each worker find its own: ``CKPT_CORE_HOST`` if set, else the
node address Ray reports when this process already runs under Ray, else the address the
machine's host name resolves to.
"""

from __future__ import annotations

import os
import socket
import sys

AUTO = "auto"
HOST_ENV = "CKPT_CORE_HOST"


def node_address() -> str:
    """This node's address for peers to reach; ``OSError`` when the host name does not resolve."""
    explicit = os.environ.get(HOST_ENV, "").strip()
    if explicit:
        return explicit
    ray = sys.modules.get("ray")  # only where Ray is already in use: never imported for this
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return socket.gethostbyname(socket.gethostname())
