"""ckpt-verl: every installed ckpt-core backend as a verl checkpoint engine.

Select one in verl's config (``actor_rollout_ref.rollout.checkpoint_engine.backend=ckpt_gloo_cpu``)
with its options under ``engine_kwargs.ckpt_gloo_cpu``; :mod:`ckpt_verl.registration` registers
the names (``import verl`` loads it through the ``verl.plugins`` entry point), and
:class:`ckpt_verl.engine.CkptVerlEngine` maps verl's lifecycle onto the ckpt-core engine's.
This package imports verl only in those two modules.
"""
