"""Helpers shared by the core tests (imported as ``tests.helpers.<module>``)."""
