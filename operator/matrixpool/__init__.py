"""matrixpool: a kopf operator that pools accelerator cards into supernodes.

Floors, outermost first (enforced by import-linter, pyproject.toml): ``controllers`` (the loop
and the controllers, kopf handlers), ``state`` (what a controller reads: the kopf indexes, the
World, the decisions), ``k8s`` (the only code that talks to the API server and the daemons),
``placement``, ``timeshare`` and ``serving`` (pure policy), ``api`` (pydantic models of the
CRDs). Beside them: ``kubectl`` (the plugin, run with a user's credentials), ``deviceplugin``
(on every node), ``simulate`` (goodput over simulated months) and ``devcluster`` (the local
control plane for tests and demos, which the operator never imports).
"""

__version__ = "0.1.0"
