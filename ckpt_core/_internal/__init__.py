"""ckpt-core's internals: the bucket pipeline, the wire format, reassembly, host memory,
checksums, dtype names and rendezvous authentication.

Private: nothing outside ckpt-core imports from here, and names may change in any release.
Transport authors get what they need of it through :mod:`ckpt_core.transport`.
"""
