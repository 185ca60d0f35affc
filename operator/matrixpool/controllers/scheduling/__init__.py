"""The scheduling cycle: keeps the pods of every gang in existence, places whole gangs onto
cards, preempts lower priorities, binds, and writes each workload's status. The main loop
(:mod:`matrixpool.controllers.loop`) calls :func:`.cycle.run_cycle`.

One module per concern, each importing only those below it (an import-linter contract keeps
the order):

- :mod:`.cycle` — the entry: ``run_cycle``, ``settle`` and ``Cycle``, its phases in order.
  Orchestration only.
- :mod:`.placement` — phase 5: pending gangs placed whole, highest priority first; shrunk
  elastic jobs grown back. Calls :mod:`.preemption` when a gang fits only by taking cards.
- :mod:`.preemption` — victims asked to checkpoint, then giving up their pods (phase 4b);
  :mod:`.gangpods` — the gangs each workload wants, their pods created and deleted to match,
  and what a new pod is told (phases 2-3); :mod:`.binding` — reservations and Bindings
  (phases 4 and 6). These three never import each other.
- :mod:`.status` — each workload's status composed and written (phase 7), and what the cycle
  last wrote of it; the table of who writes which status field.
- :mod:`.kvadmission` — the KV-cache pool admission of InferenceServices.
- :mod:`.cyclestate` — what the cycle keeps: ``Memory`` between runs, ``CycleState`` within
  one, the hand-offs between phases (``Pending``, ``Binding``). Decides nothing.

This file holds no code: import the module that holds what you need.
"""
