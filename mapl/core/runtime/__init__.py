"""The multi-process pipeline runtime (one process per stage, x R data-parallel replicas).

Read ``mapl.core.schedule`` first (GPipe and 1F1B as per-stage programs of compute and communication batches,
and a checker that proves them deadlock-free under rendezvous (NCCL) semantics; the memory plan and the link
clock read the same programs), then:

* ``transport``  messages as raw bytes between neighbouring stages; blocking (tests) and
  non-blocking modes; the real-delay link emulation;
* ``messages``   what a stage sends and expects (payload, token ids, the dtype handshake);
* ``worker``     ``PipelineEngine``: one stage executing its program, driven by ``mapl.core.loop``;
* ``agreement``  the step's one all-reduce (global clipping, loss, stop request, non-finite flags);
* ``mapl.core.boundary_sync`` receiver-side gradients, learned state and checksums (shared with the
  single-process ``mapl.core.engine``);
* ``same_run``   before any work: every rank's resolved config, shared options, data and code
  fingerprints compared (ranks started for different runs all refuse, naming the fields);
* ``rank_checkpoints``, ``measure``, ``faults``, ``topology``, ``rank`` (one rank from an initialised
  process group to its results), ``rank_process`` (the rank's process: its process group, the same-run
  check, its exit code) and ``rank_status`` (how it tells its launcher why it ended).

The command is ``mapl pipeline`` (``mapl.cli.pipeline``, flags only); starting its ranks, directly or under
accelerate or torchrun, is orchestration's (``mapl.orchestration.launch``, ``pipeline_launch``).
"""
