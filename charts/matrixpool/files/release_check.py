"""`helm test` of the matrixpool chart (templates/tests/release-check.yaml runs it in the
operator's image, standard library only, on its ServiceAccount's token): the operator answers
on its health endpoint, and every node the checkpoint DaemonSet runs on has announced its
daemon with a fresh Lease (matrixpool-daemon-<node>, label matrixpool.dev/ckpt-daemon=true,
holderIdentity the node, renewed within leaseDurationSeconds) in the release namespace.

Environment: NAMESPACE, RELEASE, HEALTH_PORT, DAEMONSET (empty: the daemons are off),
WAIT_SECONDS (how long the checks may take to pass). Exits 0 when all pass, 1 with the reasons.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from typing import Any

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def api(path: str, **query: str) -> Any:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    if ":" in host:
        host = f"[{host}]"
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    with open(f"{ACCOUNT}/token") as token:
        headers = {"Authorization": f"Bearer {token.read().strip()}"}
    url = f"https://{host}:{port}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    context = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        return json.load(response)


def operator_problems(namespace: str, release: str, port: str) -> list[str]:
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
    pods = api(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)["items"]
    pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if not pods:
        return ["no operator pod"]
    problems = []
    for pod in pods:
        name, ip = pod["metadata"]["name"], pod.get("status", {}).get("podIP")
        if not ip:
            problems.append(f"operator pod {name} has no address yet")
            continue
        host = f"[{ip}]" if ":" in ip else ip
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as response:
                if response.status != 200:
                    problems.append(f"operator {name} /healthz answered {response.status}")
        except OSError as error:
            problems.append(f"operator {name} /healthz on {host}:{port}: {error}")
    return problems


def daemon_problems(namespace: str, daemonset: str) -> list[str]:
    ds = api(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{daemonset}")
    wanted = ds.get("status", {}).get("desiredNumberScheduled", 0)
    if not wanted:
        return [f"DaemonSet {daemonset} runs on no node (its nodeSelector and tolerations)"]
    selector = ",".join(f"{k}={v}" for k, v in ds["spec"]["selector"]["matchLabels"].items())
    pods = api(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)["items"]
    nodes = sorted({p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")})
    problems = []
    if len(nodes) < wanted:
        problems.append(f"{len(nodes)} daemon pods bound, {wanted} nodes want one")
    leases = api(
        f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
        labelSelector="matrixpool.dev/ckpt-daemon=true",
    )["items"]
    by_node = {lease["spec"].get("holderIdentity"): lease["spec"] for lease in leases}
    now = datetime.now(UTC)
    for node in nodes:
        spec = by_node.get(node)
        if spec is None or not spec.get("renewTime"):
            problems.append(f"node {node}: its daemon has not announced itself (no Lease)")
            continue
        renewed = datetime.fromisoformat(spec["renewTime"].replace("Z", "+00:00"))
        age = (now - renewed).total_seconds()
        if age > spec.get("leaseDurationSeconds", 40):
            problems.append(f"node {node}: its daemon's Lease was last renewed {age:.0f} s ago")
    return problems


def main() -> int:
    namespace, release = os.environ["NAMESPACE"], os.environ["RELEASE"]
    daemonset = os.environ.get("DAEMONSET", "")
    deadline = time.monotonic() + float(os.environ.get("WAIT_SECONDS", "120"))
    while True:
        problems = operator_problems(namespace, release, os.environ["HEALTH_PORT"])
        if daemonset:
            problems += daemon_problems(namespace, daemonset)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(3)
    for problem in problems:
        print(f"FAIL {problem}", flush=True)
    if not problems:
        print("operator healthy" + (", every daemon announced" if daemonset else ""), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
