"""The seed lifecycle of one engine as a state machine: which call may come next, one refit at
a time, and which refits a ``finalize()`` cut off.

``prepare()`` -> ``init_policy_process_group`` or ``init_rollout_process_group`` -> refits ->
``finalize()`` (then ``prepare()`` again). A call out of order is a ``LifecycleError`` naming
the state the engine is in and what to call; a failed refit leaves the engine ``FAILED`` until
``finalize()``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from ckpt_core.errors import LifecycleError


class Phase(enum.Enum):
    NEW = "new (call prepare())"
    PREPARED = "prepared (call init_policy_process_group or init_rollout_process_group)"
    POLICY = "initialized as a policy worker"
    ROLLOUT = "initialized as a rollout worker"
    FAILED = "failed (a refit failed: call finalize(), then prepare() and init again)"


class Lifecycle:
    """Where one engine (``owner`` names its class in errors) is in its lifecycle."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.phase = Phase.NEW
        self.rank = -1
        """The worker's rank in its role, from its init."""
        self.refit_index = 0
        """Refits completed since the init."""
        self.generation = 0
        """``finalize()`` calls so far: a refit that outlives one was cut off."""
        self._busy = False

    def require(self, phase: Phase, call: str) -> None:
        if self.phase is not phase:
            raise LifecycleError(
                f"{self.owner}.{call} needs the engine to be {phase.name.lower()}, but it is {self.phase.value}"
            )

    def enter(self, phase: Phase, rank: int) -> None:
        """An init completed: the engine is ``phase`` (``POLICY`` or ``ROLLOUT``) as ``rank``."""
        self.phase = phase
        self.rank = rank
        self.refit_index = 0

    def finalized(self) -> None:
        self.phase = Phase.NEW
        self.refit_index = 0
        self._busy = False
        self.generation += 1

    @contextlib.contextmanager
    def refit_slot(self, call: str) -> Iterator[None]:
        """Holds the engine's one refit slot; a second concurrent refit is refused."""
        if self._busy:
            raise LifecycleError(
                f"{self.owner}.{call}: a refit is already in progress on this engine; await it before starting another"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def raise_if_cut_off(self, generation: int, call: str, exc: BaseException) -> None:
        """A refit that started in ``generation`` raised ``exc``: if ``finalize()`` ran meanwhile
        (from the weights generator, the loader or another thread), its torn-down transport is
        the cause, so the caller gets a ``LifecycleError`` and the engine stays finalized."""
        if generation != self.generation and isinstance(exc, Exception):
            raise LifecycleError(
                f"{self.owner}.{call}: finalize() was called during this refit, which voids it; finalize only "
                "after the refit's call returned or raised"
            ) from exc
