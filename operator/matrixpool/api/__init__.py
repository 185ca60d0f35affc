"""Pydantic models of the matrixpool CRDs: the single source of truth for the API.

One module per kind (``supernode``, ``trainingjob``, ``inferenceservice``), shared pieces in
``common`` (conditions, label selectors, the wire base model), label and annotation names in
``labels``. ``python -m matrixpool.api.crdgen`` turns the models into ``crds/`` and the chart's
CRD templates. Callers import modules, not names::

    from matrixpool.api import supernode
    sn = supernode.parse(body)          # the whole object, as kopf or the API hands it over

Imports neither kopf nor a Kubernetes client; this ``__init__`` imports nothing at all so the
constants below are cheap to reach from anywhere.

What may be written here: the wire models, their validation (OpenAPI bounds, CEL rules) and
the names on the wire. No behaviour beyond parsing and defaults.
"""

GROUP = "matrixpool.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# The category every matrixpool CRD carries: `kubectl get matrixpool` lists them all.
CATEGORY = "matrixpool"
