"""Kubernetes API clients, built once per process from a kubeconfig or the in-cluster config.

Every module that talks to the API gets its clients here (controllers through
:func:`default_api`, the local dev cluster through :func:`from_kubeconfig`), so connection
settings — pool size, timeouts, QPS — live in one place.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes

NAMESPACE_VARIABLE = "MATRIXPOOL_NAMESPACE"  # the operator's namespace (the chart sets it)
NAMESPACE_TERMINATING = "NamespaceTerminating"  # the StatusCause of a create into a going namespace
# Enough connections for the concurrent bindings and status patches of a large supernode.
POOL_SIZE = 64


@dataclass(frozen=True)
class Api:
    """The typed API groups matrixpool uses, sharing one connection pool."""

    client: Any  # kubernetes.client.ApiClient
    core: Any  # CoreV1Api
    custom: Any  # CustomObjectsApi
    extensions: Any  # ApiextensionsV1Api
    coordination: Any  # CoordinationV1Api


def from_kubeconfig(path: Path | None = None) -> Api:
    """Clients for the cluster in ``path`` (default: $KUBECONFIG, then in-cluster config)."""
    configuration = kubernetes.client.Configuration()
    config: Any = kubernetes.config  # the loaders are untyped
    if path is not None:
        config.load_kube_config(config_file=str(path), client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = POOL_SIZE
    client = kubernetes.client.ApiClient(configuration)
    return Api(
        client=client,
        core=kubernetes.client.CoreV1Api(client),
        custom=kubernetes.client.CustomObjectsApi(client),
        extensions=kubernetes.client.ApiextensionsV1Api(client),
        coordination=kubernetes.client.CoordinationV1Api(client),
    )


@functools.cache
def default_api() -> Api:
    """The process-wide clients of the operator."""
    return from_kubeconfig(None)


def is_status(error: BaseException, *codes: int) -> bool:
    """Whether ``error`` is an API error with one of the HTTP ``codes``."""
    return isinstance(error, kubernetes.client.ApiException) and error.status in codes


def forbidden(error: BaseException) -> str | None:
    """The API server's message when ``error`` is a 403 (RBAC refused the call), else None.
    A namespace being deleted also answers 403 to a create; that is no missing rule."""
    if not is_status(error, 403):
        return None
    body = getattr(error, "body", None) or ""
    try:
        status = json.loads(body)
    except ValueError:
        return str(body or error)
    if not isinstance(status, dict):
        return str(body or error)
    causes = (status.get("details") or {}).get("causes") or []
    if any(c.get("type") == NAMESPACE_TERMINATING for c in causes if isinstance(c, dict)):
        return None
    return str(status.get("message") or error)


def operator_namespace() -> str:
    """The operator's namespace: $MATRIXPOOL_NAMESPACE, else default. The anchor of its main
    loop and the checkpoint daemons' Leases live there."""
    return os.environ.get(NAMESPACE_VARIABLE) or "default"
