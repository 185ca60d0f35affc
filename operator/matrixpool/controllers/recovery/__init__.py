"""Fault recovery of TrainingJobs: detect, decide, carry out, record (DESIGN.md, "Recovery
contract"). The main loop (:mod:`matrixpool.controllers.loop`) calls
:func:`.controller.run` before every scheduling cycle.

One module per step, each importing only those below it (an import-linter contract keeps the
order):

- :mod:`.controller` — the entry: ``run`` (one pass: probe, then each TrainingJob) and
  ``step`` (one job: carry out, or detect and decide), the per-job backoff. Dispatch only.
- :mod:`.decide` — a level from ``matrixpool_recovery.policy``, the step pinned, the plan
  (:class:`matrixpool.state.decisions.RecoveryPlan`) written before any pod is touched.
- :mod:`.carry_out` — the plan carried out, recorded in ``status.recoveries``, or the job
  failed; :mod:`.detect` — the faults under a bound gang (pure); :mod:`.checkpoints` — the
  ``status.checkpoints`` poll; :mod:`.heartbeat` — the daemons' probe and the kubelets'
  Lease clock. These four never import each other.
- :mod:`.memory` — what recovery remembers between passes (``State``), and the backoff delay.
  Bookkeeping only: no I/O, no decision.

This file holds no code: import the module that holds what you need.
"""
