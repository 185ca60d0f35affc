"""Serving: what an inference instance does with requests, and how many instances a load needs.

Pure code, no kopf and no Kubernetes client (import-linter enforces it):

- ``latency``: the latency model of one instance (prefill and decode rates per card, KV bytes
  per token, block transfer times), its constants stated with their sources;
- ``engine``: a continuous-batching instance driven by explicit time;
- ``server``: that engine behind an HTTP completions endpoint with Prometheus metrics, the
  matrixpool image's serving entry point (``python -m matrixpool.serving``);
- ``workload`` and ``loadgen``: a day's requests as data, and a client that sends them;
- ``estimator``: from load factors to the prefill and decode replicas an SLO needs.

What may be written here: the serving engine, its latency model and the sizing rules, as
functions of their inputs and of explicit time. No kopf, no Kubernetes client.
"""
