"""Conformance kit for CheckpointEngine transports (see docs/writing-a-transport.md)."""
