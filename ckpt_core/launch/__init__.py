"""Launchers: how coordinator calls reach workers (local subprocesses here, Ray in ckpt_core.ray)."""
