"""NeMo RL's ``nemo_rl.utils.checkpoint_engines.base``, under our name: the five names of the seed.

Code written against NeMo RL's module imports the same names from here. They live in
:mod:`ckpt_core.contract` (``TensorMeta``, ``CheckpointEngine``), :mod:`ckpt_core.chunking`
(``split_weight_chunks``, ``merge_weight_chunk_batches``) and :mod:`ckpt_core.registry`
(``create_checkpoint_engine``); nothing inside ckpt-core imports this module.
"""

from __future__ import annotations

from ckpt_core.chunking import merge_weight_chunk_batches, split_weight_chunks
from ckpt_core.contract import CheckpointEngine, TensorMeta
from ckpt_core.registry import create_checkpoint_engine

__all__ = [
    "CheckpointEngine",
    "TensorMeta",
    "create_checkpoint_engine",
    "merge_weight_chunk_batches",
    "split_weight_chunks",
]
