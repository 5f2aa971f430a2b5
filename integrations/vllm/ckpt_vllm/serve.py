"""Kept import path (the flat layout's): the code lives in :mod:`ckpt_vllm.devtools.serve`, a
local ``vllm serve`` with the ``"ckpt"`` backend selected."""

from ckpt_vllm.devtools.serve import STOP_GRACE_S, free_port, local_vllm_serve, serve_command

__all__ = ["STOP_GRACE_S", "free_port", "local_vllm_serve", "serve_command"]
