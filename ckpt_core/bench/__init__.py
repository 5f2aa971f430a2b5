"""Bench tooling: the ``ckpt-engine bench`` job (:mod:`~ckpt_core.bench.job`), the raw
``torch.distributed`` floor it is measured against (:mod:`~ckpt_core.bench.baselines`),
transformer-shaped synthetic weights (:mod:`~ckpt_core.bench.synthetic`) and a live progress
line (:mod:`~ckpt_core.bench.progress`). The side-by-side benchmarks of the repository
(``benchmarks/``) build on it; :mod:`~ckpt_core.bench.produce` makes weights while a refit runs.
"""

PRODUCE_MODES = ("cast-bf16", "fill")
"""How :mod:`ckpt_core.bench.produce` makes each weight (here so the CLI can offer them without
importing torch)."""
