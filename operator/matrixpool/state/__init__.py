"""What a controller reads, built once per pass of the main loop.

- :mod:`~matrixpool.state.indexes`: every kopf index (Nodes, Leases, pods, SuperNodes,
  workloads), the watches' in-memory caches;
- :mod:`~matrixpool.state.workloads`: the workload model (:class:`Workload`);
- :mod:`~matrixpool.state.world`: the :class:`World` of one pass and the answers every
  controller shares (topologies, holdings, replicas now, recovering, failed, succeeded);
- :mod:`~matrixpool.state.assumed`: the reservations, bindings and deletions the operator made
  and the watch does not show yet;
- :mod:`~matrixpool.state.decisions`: what one controller decided for the others
  (:class:`RecoveryPlan`, :class:`Preempting`, time-sharing's :class:`Shares`).

What may be written here: types and pure reads of memory. Nothing here calls the API server or
a daemon, imports a controller or keeps module-level state (import-linter contracts in
pyproject.toml; ``tests/unit/controllers/test_identity.py``). A controller writes only through the
executor (:mod:`matrixpool.k8s.executor`) and the Decisions the loop owns.
"""
