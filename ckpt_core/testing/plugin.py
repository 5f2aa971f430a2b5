"""pytest plugin entry point (``pytest11``) of the ckpt-core conformance kit."""
