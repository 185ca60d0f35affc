"""What matrixpool hands to the schedulers that run beside it (Kueue, Volcano): pure functions of
the SuperNodes and their nodes' labels, called by ``matrixpool export`` (matrixpool.cli).
Imports neither kopf nor a Kubernetes client."""
