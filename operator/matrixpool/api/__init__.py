"""Pydantic models of the matrixpool CRDs: the single source of truth for the API.

``python -m matrixpool.api.crdgen`` turns them into ``crds/`` and the chart's CRD templates.
Imports neither kopf nor a Kubernetes client.
"""
