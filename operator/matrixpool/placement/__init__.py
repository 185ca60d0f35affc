"""Pure topology-aware gang placement (no kopf, no Kubernetes client).

``engine`` places gangs on a ``snapshot`` of the cards held, with the strategies ``choose``,
``firstfit``, ``preemption`` and ``diagnose`` (why a gang does not fit) over the value types of
``model``, ``cards``, ``servable``, ``inventory`` and ``nodefit``; ``gangs`` turns workload specs
into gang requests. Layers in pyproject.toml.

What may be written here: functions of their inputs. "Does not fit" is data (a reason), not an
exception; no I/O, no clock, no memory between calls.
"""
