"""Writes the status subresource of matrixpool objects, with retries on transient errors.

Handlers call :func:`patch_cluster_status` / :func:`patch_status` from async code; the blocking
client call runs in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tenacity

from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import pods

GROUP = "matrixpool.dev"
VERSION = "v1alpha1"


def _transient(error: BaseException) -> bool:
    return k8s_client.is_status(error, 409, 429, 500, 502, 503, 504) or isinstance(
        error, (ConnectionError, TimeoutError)
    )


_retry = tenacity.retry(
    retry=tenacity.retry_if_exception(_transient),
    wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=5),
    stop=tenacity.stop_after_attempt(8),
    reraise=True,
)


async def patch_cluster_status(plural: str, name: str, status: Mapping[str, Any]) -> None:
    """Merge-patch ``status`` into the cluster-scoped object ``plural/name``."""

    @_retry
    def call() -> None:
        k8s_client.default_api().custom.patch_cluster_custom_object_status(
            GROUP, VERSION, plural, name, {"status": dict(status)}
        )

    await pods.in_thread(call)


async def patch_status(plural: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
    """Merge-patch ``status`` into the namespaced object ``plural/namespace/name``."""

    @_retry
    def call() -> None:
        try:
            k8s_client.default_api().custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, plural, name, {"status": dict(status)}
            )
        except Exception as error:
            if not k8s_client.is_status(error, 404):  # deleted meanwhile: nothing to report
                raise

    await pods.in_thread(call)
