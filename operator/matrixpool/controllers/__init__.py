"""The controllers: the main loop and what it runs each pass, each acting only through the
executor (:mod:`matrixpool.k8s.executor`) on what it read from the World
(:mod:`matrixpool.state`).

- :mod:`~matrixpool.controllers.loop`: the kopf daemon that runs a pass every 0.25 s (and
  when :mod:`~matrixpool.controllers.wake` rings), and owns every controller's memory;
- :mod:`~matrixpool.controllers.scheduling`: which pods each workload wants, placement,
  preemption, the binding cycle, the workloads' status, KV-cache admission;
- :mod:`~matrixpool.controllers.recovery`: detect faults, decide a level, carry it out (one
  module per step, entered by :mod:`~matrixpool.controllers.recovery.controller`);
- :mod:`~matrixpool.controllers.timeshare`, :mod:`~matrixpool.controllers.autoscaler`,
  :mod:`~matrixpool.controllers.supernode` (status), :mod:`~matrixpool.controllers.lifecycle`
  (jobs that finished), :mod:`~matrixpool.controllers.cleanup` (orphaned checkpoints),
  :mod:`~matrixpool.controllers.credentials` (per-job Secrets),
  :mod:`~matrixpool.controllers.jobservice` (per-job headless Services),
  :mod:`~matrixpool.controllers.ranktable` (Ascend jobs' HCCL rank tables), and the daemons'
  tier-1 peers and KV-cache quotas.

What may be written here: a controller module with the memory it keeps between passes (a
dataclass the loop owns: no module-level state), its decisions, and its calls to the
executor. Pure rules belong in the pure packages (placement, timeshare, serving,
matrixpool_recovery); what every controller reads belongs in :mod:`matrixpool.state`.
"""
