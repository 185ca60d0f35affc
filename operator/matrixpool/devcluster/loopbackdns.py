"""DNS records of the local cluster's loopback pods: what the endpointslice controller and
CoreDNS's kubernetes plugin would answer for them, written to the hosts file that the cluster's
CoreDNS serves ahead of its kubernetes plugin (:mod:`.dns`).

Why: the pods of kwok nodes have loopback addresses (kwok's 127.200.0.0/16, where the pods
``matrixpool sim`` runs serve), and the API refuses a loopback address in an EndpointSlice, so
a headless Service of such pods gets no endpoints and no names. For every headless Service with
a selector this gives, per the Kubernetes DNS specification, over its matching pods that have a
loopback address (Ready, or any with ``publishNotReadyAddresses``; none that ended):

    <service>.<ns>.svc.<domain>              every such pod's address
    <hostname>.<service>.<ns>.svc.<domain>   a pod with spec.hostname and spec.subdomain =
                                             <service>; else <a-b-c-d>.<service>.<ns>.svc...

Other Services and pods with routable addresses (the real nodes') are the kubernetes plugin's,
from their EndpointSlices, as in a real cluster.

Run by ``cluster up`` as a process of the cluster (``python -m matrixpool.devcluster.loopbackdns
--kubeconfig K --records FILE``): it lists and watches pods and Services and rewrites FILE
(atomically) when the records change; CoreDNS reads it again within a second.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matrixpool.devcluster import dns

WATCH_SECONDS = 240  # each watch ends after this and is made afresh from a new list
RETRY_SECONDS = 1.0  # after an error (the API server restarting)
SETTLE_SECONDS = 0.1  # changes arriving together are written once
HEADER = "# Records of loopback pods, written by matrixpool.devcluster.loopbackdns.\n"


def loopback_records(
    services: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    domain: str = dns.DOMAIN,
) -> str:
    """The hosts file: one ``<address>\\t<name>`` line per record, sorted."""
    by_namespace: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        if _address(pod):
            by_namespace.setdefault(_meta(pod).get("namespace", ""), []).append(pod)
    lines = set()
    for service in services:
        spec, meta = service.get("spec") or {}, _meta(service)
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") != "None" or not selector:
            continue
        name, namespace = meta.get("name", ""), meta.get("namespace", "")
        zone = f"{name}.{namespace}.svc.{domain}"
        publish = bool(spec.get("publishNotReadyAddresses"))
        for pod in by_namespace.get(namespace, []):
            labels = _meta(pod).get("labels") or {}
            if any(labels.get(k) != v for k, v in selector.items()) or not _serves(pod, publish):
                continue
            address = _address(pod)
            pod_spec = pod.get("spec") or {}
            if pod_spec.get("hostname") and pod_spec.get("subdomain") == name:
                host = pod_spec["hostname"]
            else:
                host = address.replace(".", "-")
            lines.add(f"{address}\t{zone}")
            lines.add(f"{address}\t{host}.{zone}")
    return HEADER + "".join(f"{line}\n" for line in sorted(lines))


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _address(pod: Mapping[str, Any]) -> str:
    """The pod's IPv4 address if it is a loopback one, else ""."""
    ip = str((pod.get("status") or {}).get("podIP") or "")
    try:
        return ip if ipaddress.IPv4Address(ip).is_loopback else ""
    except ValueError:
        return ""


def _serves(pod: Mapping[str, Any], publish_not_ready: bool) -> bool:
    """Whether the endpointslice controller would mark the pod's endpoint ready
    (podToEndpoint): not ended; Ready and not terminating, or any with
    publishNotReadyAddresses."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    if publish_not_ready:
        return True
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return ready and not _meta(pod).get("deletionTimestamp")


def slim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`loopback_records` reads of a pod or Service (the rest is not kept)."""
    meta, spec, status = _meta(obj), obj.get("spec") or {}, obj.get("status") or {}
    return {
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "labels", "deletionTimestamp")
            if k in meta
        },
        "spec": {
            k: spec[k]
            for k in ("hostname", "subdomain", "clusterIP", "selector", "publishNotReadyAddresses")
            if k in spec
        },
        "status": {k: status[k] for k in ("podIP", "phase", "conditions") if k in status},
    }


class Mirror:
    """Pods and Services as their watches show them, and the records file kept current."""

    def __init__(self, api: Any, records: Path, domain: str = dns.DOMAIN) -> None:
        self.api = api
        self.records = records
        self.domain = domain
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "services": {}}
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        """Follow pods and Services (a thread each) and write the records until stopped."""
        calls: Sequence[tuple[str, Callable[..., Any]]] = (
            ("pods", self.api.core.list_pod_for_all_namespaces),
            ("services", self.api.core.list_service_for_all_namespaces),
        )
        for kind, call in calls:
            threading.Thread(target=self.follow, args=(kind, call), daemon=True).start()
        written = None
        while not self.stop.is_set():
            if not self.changed.wait(timeout=1.0):
                continue
            self.stop.wait(SETTLE_SECONDS)
            self.changed.clear()
            with self.lock:
                text = loopback_records(
                    self.objects["services"].values(), self.objects["pods"].values(), self.domain
                )
            if text != written:
                write_atomically(self.records, text)
                written = text

    def follow(self, kind: str, call: Callable[..., Any]) -> None:
        """List, then watch from that version; list again when the watch ends or fails."""
        while not self.stop.is_set():
            try:
                listed = json.loads(call(resource_version="0", _preload_content=False).data)
                with self.lock:
                    self.objects[kind] = {
                        o["metadata"]["uid"]: slim(o) for o in listed.get("items") or []
                    }
                self.changed.set()
                response = call(
                    watch=True,
                    resource_version=listed["metadata"]["resourceVersion"],
                    allow_watch_bookmarks=True,
                    timeout_seconds=WATCH_SECONDS,
                    _preload_content=False,
                )
                for line in response:  # urllib3 yields the stream line by line: an event each
                    if line.strip() and not self.apply(kind, json.loads(line)):
                        break
                response.release_conn()
            except Exception as error:  # the API server restarting: list again soon
                print(f"loopbackdns: {kind}: {error}; listing again", file=sys.stderr)
                self.stop.wait(RETRY_SECONDS)

    def apply(self, kind: str, event: Mapping[str, Any]) -> bool:
        """Take one watch event; False when the watch must start over (an ERROR: expired)."""
        kind_of_event, obj = event.get("type"), event.get("object") or {}
        if kind_of_event == "ERROR":
            return False
        if kind_of_event == "BOOKMARK":
            return True
        uid = obj["metadata"]["uid"]
        with self.lock:
            if kind_of_event == "DELETED":
                self.objects[kind].pop(uid, None)
            else:
                self.objects[kind][uid] = slim(obj)
        self.changed.set()
        return True


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text)
    staging.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrixpool.devcluster.loopbackdns")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--records", type=Path, required=True, help="the hosts file to write")
    parser.add_argument("--domain", default=dns.DOMAIN)
    args = parser.parse_args(argv)
    from matrixpool.k8s import client as k8s_client

    mirror = Mirror(k8s_client.from_kubeconfig(args.kubeconfig), args.records, args.domain)
    signal.signal(signal.SIGTERM, lambda *_: mirror.stop.set())
    mirror.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
