"""A driver's side of refits into a vLLM engine it holds (``vllm.LLM``):
:class:`~ckpt_vllm.driver.rollout.VllmRollout` makes vLLM's weight-transfer calls and the
worker extension's, and :class:`~ckpt_vllm.driver.pool.VllmWorkerPool` hands its ranks to a
``RefitCoordinator``. Both are exported by :mod:`ckpt_vllm` too.
"""
