"""Moved to :mod:`ckpt_core.refit.layout` (refit kinds live in :mod:`ckpt_core.refit`); this path stays
importable for code written against it."""

from ckpt_core.refit.layout import *  # noqa: F403
from ckpt_core.refit.layout import __all__ as __all__
