"""Helpers shared by the core tests (imported as ``helpers``; ``tests/`` is on ``sys.path``)."""
