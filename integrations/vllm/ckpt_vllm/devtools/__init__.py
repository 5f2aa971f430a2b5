"""Tools for trying refits by hand and for the examples, tests and benchmarks; nothing of the
backend or the driver imports them. :mod:`~ckpt_vllm.devtools.serve`: a local ``vllm serve``
with the ``"ckpt"`` backend selected.
"""
