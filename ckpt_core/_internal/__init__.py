"""ckpt-core's internals: the bucket pipeline (pipeline.py, send.py, receive.py, the bucket plan,
fan-out and replay), the wire format, reassembly, host memory, checksums, rendezvous
authentication, the settings both sides must share (agreement), the rendezvous store and
listener fence that shut strangers out after init, node addresses for ``host="auto"``, and delta
refits' compiled loops (bitdiff, parallel).

Private: nothing outside ckpt-core imports from here, and names may change in any release.
Transport authors get what they need of it through :mod:`ckpt_core.transport`. What this
package imports from the rest of the core (the contract, tensors, hooks, stats, options,
errors) imports nothing from here: ``tests/repository/test_layering.py`` finds any loop.
"""
