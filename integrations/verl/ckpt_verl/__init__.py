"""ckpt-verl: every installed ckpt-core backend as a verl checkpoint engine.

Select one in verl's config (``actor_rollout_ref.rollout.checkpoint_engine.backend=ckpt_gloo_cpu``)
with its options under ``engine_kwargs.ckpt_gloo_cpu``; :mod:`ckpt_verl.registration` registers
the names (``import verl`` loads it through the ``verl.plugins`` entry point), and
:class:`ckpt_verl.engine.CkptVerlEngine` maps verl's lifecycle onto the ckpt-core engine's.
:class:`ckpt_verl.vllm_adapter.CkptVllmServerAdapter` lands what a rollout worker received in a
vLLM server through ckpt-vllm; :mod:`ckpt_verl.testing` stands in for verl's GPU-only parts so
its manager runs without one. This package (``import ckpt_verl``) imports no verl module itself.
"""
