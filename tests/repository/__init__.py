"""Checks of the repository itself: import hygiene, lock, option docs, benchmark and CLI smoke, gpu_check."""
