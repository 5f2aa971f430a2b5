"""Reading and writing the live vLLM model, in each worker.

* :mod:`~ckpt_vllm.model.loading`: streaming received weights into the model through vLLM's
  layerwise reload.
* :mod:`~ckpt_vllm.model.model_layout`: what the rank keeps of each checkpoint weight, derived
  from its modules (a destination layout of :mod:`ckpt_core.refit.layout`).
* :mod:`~ckpt_vllm.model.model_quantization`: which weights the model holds as FP8, derived from
  its scales (a spec of :mod:`ckpt_core.refit.quantize`), and an FP8 checkpoint for such a model.
* :mod:`~ckpt_vllm.model.lora`: LoRA adapters received by a refit, served from memory.
* :mod:`~ckpt_vllm.model.kv_cache`: zeroing the KV cache, which a model left broken by a
  failed refit may have filled with NaN.
"""
