"""ckpt-core's internals: the bucket pipeline, the wire format, reassembly, host memory,
checksums, dtype names and what may be sent (storage_check), rendezvous authentication, the
settings both sides must share (agreement), the rendezvous store and listener fence that shut
strangers out after init, node addresses for ``host="auto"``, and the plugin block list.

Private: nothing outside ckpt-core imports from here, and names may change in any release.
Transport authors get what they need of it through :mod:`ckpt_core.transport`.
"""
