"""Tests of the refit kinds above the pipeline: destination layouts, quantize-on-send, FP8, delta."""
