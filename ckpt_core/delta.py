"""Moved to :mod:`ckpt_core.refit.delta` (refit kinds live in :mod:`ckpt_core.refit`); this path stays
importable for code written against it."""

from ckpt_core.refit.delta import *  # noqa: F403
from ckpt_core.refit.delta import __all__ as __all__
