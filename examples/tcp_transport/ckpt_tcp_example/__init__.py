"""ckpt-tcp-example: a ckpt-core transport over plain TCP sockets (a worked example)."""

from .engine import TcpExampleEngine

__all__ = ["TcpExampleEngine"]
