"""A trace-driven discrete-event simulator of months of training on many supernodes.

``matrixpool simulate FILE`` and ``benchmarks/goodput.py`` call it. It drives the real
decision code over simulated time, without an API server: gangs are placed by
:mod:`matrixpool.placement.engine`, recoveries are chosen by
:func:`matrixpool_recovery.policy.decide`, and the day/night split comes from
:func:`matrixpool.timeshare.split.target_split`. What the simulator adds is the model: a seeded
failure process (:mod:`.failures`) and the seconds each recovery costs (:mod:`.costs`), every
figure cited in the YAML file that configures a run (:mod:`.model`).

Modules, lowest first: ``model`` (configuration and YAML loading), ``failures`` (the fault
trace), ``costs`` (recovery and restore seconds), ``cluster`` (the engine's snapshot, spares and
down nodes), ``run`` (the event loop, one policy at a time), ``report`` (JSON and PNGs).

Errors::

    ValueError
      └── model.ConfigError   a field of the YAML file is missing, unknown or out of range

What may be written here: the model of time and faults around the operator's own decision
code, never a second copy of a decision.
"""
