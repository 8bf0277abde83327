"""The multi-process pipeline runtime (one process per stage, x R data-parallel replicas).

Read in this order:

* ``schedule``   GPipe and 1F1B as per-stage programs of compute and communication batches, and a
  checker that proves them deadlock-free under rendezvous (NCCL) semantics;
* ``transport``  messages as raw bytes between neighbouring stages; blocking (tests) and
  non-blocking modes; the real-delay link emulation;
* ``messages``   what a stage sends and expects (payload, token ids, the dtype handshake);
* ``worker``     ``PipelineEngine``: one stage executing its program, driven by ``mapl.core.loop``;
* ``agreement``  the step's one all-reduce (global clipping, loss, stop request, non-finite flags);
* ``boundary_sync`` receiver-side gradients, learned state and checksums (shared with ``mapl.core.engine``);
* ``same_run``   before any work: every rank's resolved config, shared options, data and code
  fingerprints compared (ranks started for different runs all refuse, naming the fields);
* ``rank_checkpoints``, ``measure``, ``faults``, ``topology``, ``rank`` (one rank from start to end),
  ``launch`` (starting the ranks directly, under accelerate or torchrun, or on several "machines").

The CLI is ``python -m mapl.pipeline`` (mapl/pipeline.py).
"""
