"""matrixpool: a kopf operator that pools accelerator cards into supernodes.

Sub-packages, outermost first (enforced by import-linter): ``handlers`` (kopf), ``k8s`` (the
only code that talks to the API), ``placement`` and ``timeshare`` (pure policy), ``api``
(pydantic models of the CRDs). ``devcluster`` runs the local control plane for tests and demos.
"""

__version__ = "0.1.0"
