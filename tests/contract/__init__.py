"""Tests of the consumer contract: TensorMeta, chunking, the seed API, registry, options, hooks."""
