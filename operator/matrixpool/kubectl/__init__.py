"""The kubectl plugin (``kubectl matrixpool`` = ``kubectl-matrixpool``, also ``matrixpool
status|cards|jobs|recoveries``): what users look at day to day.

``report`` turns API objects (plain dicts) into rows and card cells and is pure; ``render``
turns those into terminal text (ANSI colours) and PNG images; ``cli`` reads the API and
prints. Imports no kopf: the plugin runs on a user's laptop against any cluster.

What may be written here: reads of the API with the user's own credentials and how they are
shown. No controller, no operator state (import-linter), no writes to the cluster.
"""
