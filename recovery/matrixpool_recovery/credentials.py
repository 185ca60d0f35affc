"""Scoped credentials of the checkpoint data plane, derived from one cluster secret.

The chart keeps one random secret per cluster (a Secret mounted into the daemons and the
operator only). Nothing sends that secret over the wire; the bearer tokens are derived from it:

* ``job_token(secret, job)`` — one job's credential (``job`` is the TrainingJob's UID). The
  operator writes it into a per-job Secret its pods mount; a daemon accepts it only on that
  job's routes (``/v1/jobs/<job>/...``, ``/v1/inventory?job=<job>``, ``/v1/info?job=<job>``).
* ``service_token(secret, service)`` — one inference service's credential (``service`` is the
  InferenceService's UID): its KV-cache blocks, quota usage and nothing else
  (``/v1/kv/<service>/blocks/...``, ``/v1/kv/<service>/usage``). It is derived under another
  scope name than a job's, so a job's token never opens a service's KV blocks nor a service's
  token a job's checkpoints, even for the same UID.
* ``operator_token(secret)`` — the operator's credential: every job's and service's routes, plus
  the ones no trainer or server may call (peer lists, pins, deletes, the whole inventory, KV
  quotas).

Daemons hold the secret, so they derive both to check a request, and use a job's token when
they push that job's shard to a peer. Called by the daemon, the operator and the sim.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

JOB, SERVICE, OPERATOR = "job", "service", "operator"  # the scopes a token can have


def _derive(secret: str, *parts: str) -> str:
    message = "\0".join(("matrixpool-ckpt", *parts)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def metrics_label(secret: str, service: str) -> str:
    """What a daemon's metrics call a service: 16 hex characters of a keyed digest of its UID,
    the same on every daemon, opaque to whoever lacks the cluster secret (the operator maps
    it back by computing it)."""
    return _derive(secret, "metrics", service)[:16]


def job_token(secret: str, job: str) -> str:
    """The bearer token that opens one job's checkpoints, and nothing else."""
    return _derive(secret, JOB, job)


def service_token(secret: str, service: str) -> str:
    """The bearer token that opens one inference service's KV-cache blocks, and nothing else."""
    return _derive(secret, SERVICE, service)


def scoped_token(secret: str, scope: str, name: str) -> str:
    """The token of a job (scope JOB) or of a service (scope SERVICE) called `name`."""
    if scope not in (JOB, SERVICE):
        raise ValueError(f"scope {scope!r}: {JOB} or {SERVICE}")
    return _derive(secret, scope, name)


def operator_token(secret: str) -> str:
    """The operator's bearer token: every job, peers, pins and deletes."""
    return _derive(secret, OPERATOR)


def matches(given: str, expected: str) -> bool:
    """Constant-time comparison of a presented token with the one derived."""
    return hmac.compare_digest(given.encode(), expected.encode())


def read_secret(path: Path) -> str:
    """The cluster secret from its file (a mounted Secret), stripped; an empty file is refused."""
    value = path.read_text().strip()
    if not value:
        raise ValueError(f"{path} holds no secret")
    return value
