"""ckpt-my-transport: the ``my_transport`` transport of ckpt-core."""

from .engine import MyTransportEngine

__all__ = ["MyTransportEngine"]
