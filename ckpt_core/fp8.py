"""Moved to :mod:`ckpt_core.refit.quantize.fp8` (refit kinds live in :mod:`ckpt_core.refit`); this path stays
importable for code written against it."""

from ckpt_core.refit.quantize.fp8 import *  # noqa: F403
from ckpt_core.refit.quantize.fp8 import __all__ as __all__
