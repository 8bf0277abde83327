"""The multi-process pipeline runtime (one process per stage).

``boundary_sync``: receiver-side gradients, learned state and checksums, shared by both engines.
"""
