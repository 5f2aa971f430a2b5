"""Tests of the transport layer: wire format, pipeline, replay, host memory, buffers, the kit."""
