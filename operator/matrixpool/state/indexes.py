"""Every kopf index the operator keeps: the in-memory caches, fed by watches, that the main loop
(:mod:`matrixpool.controllers.loop`) copies once a pass into a
:class:`~matrixpool.state.world.World`.

Nothing here writes to the API or remembers anything of its own: each function turns one
object's body into the entry kopf stores under a key. kopf fills every index from a full
listing before any daemon starts, so a restarted operator sees the same world the killed one
saw.

========================  ==========================================  ============================
index                     of                                          key → value
========================  ==========================================  ============================
``node_facts``            Nodes                                       node → NodeInfo
``daemon_leases``         checkpoint daemons' Leases (own namespace)  node → Announced
``foreign_pods``          pods matrixpool did not place               node → requests held
``supernode_models``      SuperNodes                                  name → SuperNode
``training_jobs``         TrainingJobs                                "<ns>/<name>" → Workload
``inference_services``    InferenceServices                           "<ns>/<name>" → Workload
``gang_pods``             pods labelled ``matrixpool.dev/job``        "<ns>/<owner>" → PodFacts
========================  ==========================================  ============================

The kubelets' Leases are not a kopf index: at ~300 renewals a second (64 supernodes) kopf's
per-event cost on the event loop was too much; :mod:`matrixpool.k8s.nodeleases` keeps them.

The index functions are coroutines though they never await: kopf runs a plain function in a
worker thread for every event of its resource, a hop that costs more than the function itself,
and every pod event runs two of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
import pydantic

from matrixpool import api
from matrixpool.api import common, inferenceservice, supernode, trainingjob
from matrixpool.api import labels as names
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import convert, daemonleases
from matrixpool.placement import inventory
from matrixpool.state import workloads
from matrixpool.state.workloads import Workload

# ---- nodes, leases, pods ------------------------------------------------------------------


@kopf.index("", "v1", "nodes")
async def node_facts(
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    **_: Any,
) -> dict[str, inventory.NodeInfo]:
    return {name: convert.node_info(name, labels, annotations, spec, status)}


@kopf.index(
    "coordination.k8s.io",
    "v1",
    "leases",
    labels={names.CKPT_DAEMON: "true"},
    when=lambda namespace, **_: namespace == k8s_client.operator_namespace(),
)
async def daemon_leases(
    name: str, annotations: Mapping[str, str], spec: Mapping[str, Any], **_: Any
) -> dict[str, daemonleases.Announced] | None:
    """Node → its checkpoint daemon, as the daemon's Lease announces it
    (:mod:`matrixpool.k8s.daemonleases`)."""
    announced = daemonleases.parse(name, annotations, spec)
    return {announced.node: announced} if announced is not None else None


@kopf.index("", "v1", "pods")
async def foreign_pods(
    spec: Mapping[str, Any], status: Mapping[str, Any], labels: Mapping[str, str], **_: Any
) -> dict[str, dict[str, int]] | None:
    """Node → what each live pod that matrixpool did not place requests there."""
    held = convert.foreign_requests(spec, status, labels)
    return {spec["nodeName"]: held} if held else None


@kopf.index(api.GROUP, api.VERSION, supernode.PLURAL)
async def supernode_models(name: str, body: kopf.Body, **_: Any) -> dict[str, supernode.SuperNode]:
    try:
        return {name: supernode.parse(common.plain(body))}
    except pydantic.ValidationError:
        return {}  # the CRD rejects such specs; if one slips through, it is left alone


# ---- SuperNodes and workloads ------------------------------------------------------------


@kopf.index(api.GROUP, api.VERSION, trainingjob.PLURAL)
async def training_jobs(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Workload]:
    return workloads.parse(trainingjob.KIND, body, trainingjob.parse, memo)


@kopf.index(api.GROUP, api.VERSION, inferenceservice.PLURAL)
async def inference_services(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Workload]:
    return workloads.parse(inferenceservice.KIND, body, inferenceservice.parse, memo)


@kopf.index("", "v1", "pods", labels={names.JOB: kopf.PRESENT})
async def gang_pods(
    name: str,
    namespace: str | None,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    meta: Mapping[str, Any],
    **_: Any,
) -> dict[str, convert.PodFacts] | None:
    facts = convert.pod_facts(name, namespace or "", labels, annotations, spec, status, meta)
    return {f"{namespace}/{facts.owner}": facts} if facts else None
