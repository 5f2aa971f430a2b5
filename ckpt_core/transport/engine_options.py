"""The options every :class:`~ckpt_core.transport.engine.BucketedEngine` takes, and what they mean.

A transport adds its own (``BucketedEngine.options.extend(...)``); each refit kind adds the
options of its stage (:mod:`ckpt_core.refit`).

``checksum`` is off by default on every engine: turned on, each bucket carries a digest its
receiver verifies (xxh3 on host buffers, the device checksum on GPU buffers), which catches
corruption on the way (a bad NIC, DMA engine or memory) at the price of one more read of every
byte on each side. What the options of NeMo RL's engines mean here (its config always passes the
first):

* ``release_after_refit`` (default off): NeMo RL then calls ``finalize()`` after every
  refit, and ``finalize()`` also hands cached memory back (the pooled host memory of freed
  received tensors, and, where the engine's buffers are on a GPU, torch's CUDA cache on
  that device), so that the memory is free for others until the next refit. ``finalize()``
  closes connections and drops bucket buffers either way; off, those caches stay warm for
  the next refit.
* ``shard_expert_weights``, ``quantize_for_rollout`` and ``delta`` (with
  ``delta_max_baseline_bytes``) switch on refit kinds, each a stage of
  ``refit_stages`` (:mod:`ckpt_core.refit`) whose module says what it does:
  :mod:`ckpt_core.refit.layout.stage` (NeMo RL's option, with this library's layouts),
  :mod:`ckpt_core.refit.quantize.stage`, :mod:`ckpt_core.refit.delta.stage`.

And one of this library's:

* ``borrow_received_tensors`` (default off): a tensor that arrived whole inside one bucket
  is handed out as a view of the transport's bucket buffer instead of a copy (tensors that
  spanned buckets or move to ``merge_device`` stay copies; the rollout says in its
  ``prepare()`` metadata that it borrows, and its senders then pack every chunk into their
  buckets instead of sending large ones as direct chunks, which would land in fresh memory). A
  borrowed tensor, and every view made from it, is valid only until the caller asks for
  the next batch (or the generator is closed): the buffer is then refilled with later
  bytes, which the tensor will show. Borrowed tensors are read-only: the buffer may be
  mapped read-only (cuda_ipc's host slots: a write faults the process) or shared with other
  rollouts of one broadcast (a write changes what they read). For a loader that copies each
  batch into its model at once and keeps nothing; anything kept must be ``clone()``d first.
"""

from __future__ import annotations

from ckpt_core.options import MAX_TIMEOUT_S, REQUIRED, Option, OptionSchema

__all__ = ["ENGINE_OPTIONS"]

ENGINE_OPTIONS = OptionSchema(
    Option.size(
        "bucket_size",
        REQUIRED,
        "bytes per bucket; each side holds two buffers of it",
        agreed=True,
        argument="bucket_size_bytes",
    ),
    Option.number(
        "timeout_s",
        300.0,
        "bound on every wait (rendezvous, each header, each payload)",
        maximum=MAX_TIMEOUT_S,
        kind="seconds > 0, at most 30 days",
    ),
    Option.flag(
        "checksum",
        False,
        "a digest per bucket, verified on receipt (IntegrityError on mismatch): xxh3 on host "
        "buffers, the device checksum on GPU buffers; off by default",
        agreed=True,
    ),
    Option.flag(
        "release_after_refit",
        False,
        "NeMo RL's: finalize() also hands cached memory back (the host pool of freed received "
        "tensors; torch's CUDA cache where buffers are on a GPU)",
    ),
    Option.flag(
        "borrow_received_tensors",
        False,
        "rollout side: whole tensors arrive as views of the bucket buffer (no copy), valid "
        "until the next batch is asked for",
    ),
)
"""The options of every bucketed engine, before its refit stages add theirs."""
