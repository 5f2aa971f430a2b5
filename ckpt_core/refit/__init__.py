"""Refit kinds: what a refit sends, changed above the pipeline, so every transport has them.

Each kind is a :class:`~ckpt_core.refit.stage.RefitStage` (the protocol and how the engine runs
it: :mod:`ckpt_core.refit.stage`), switched on by engine options the stage declares:

* :mod:`ckpt_core.refit.layout`: destination layouts (``shard_expert_weights``): each rollout
  rank receives only the parts of each weight it keeps;
* :mod:`ckpt_core.refit.quantize`: quantize-on-send (``quantize_for_rollout``): FP8 bytes and
  scales made with the rollout's own arithmetic (:mod:`ckpt_core.refit.quantize.fp8`);
* :mod:`ckpt_core.refit.delta`: delta refits (``delta``): patches of what changed since the
  refit the destination last completed.

Each kind is a package: its public module (the format and functions a caller uses), and its
``stage`` module (how an engine runs it).
"""

from ckpt_core.refit.stage import Batches, Destinations, RefitStage, Stream, Weights

__all__ = ["Batches", "Destinations", "RefitStage", "Stream", "Weights"]
