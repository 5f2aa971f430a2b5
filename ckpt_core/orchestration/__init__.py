"""Running the refit lifecycle over many workers: one coordinator, two launchers.

:class:`~ckpt_core.orchestration.coordinator.RefitCoordinator` drives ``prepare``, init,
refits and ``finalize`` over P policy and R rollout workers
(:class:`~ckpt_core.orchestration.worker.RefitWorker`, each hosting one engine), reached
through local subprocesses (:mod:`~ckpt_core.orchestration.local`, for tests and the CLI) or
Ray actors (:mod:`~ckpt_core.orchestration.ray`, multi-node). For RL frameworks that bring
no orchestrator of their own; one that has one calls the engines directly.
"""
