"""Builders of the custom resources the integration tests apply, reading like sentences:
``training_job("llm").replicas(48).cards(8).on("sn-0").yaml()``."""

from __future__ import annotations

import copy
import json
from typing import Any

from matrixpool.devcluster import trainer

API = "matrixpool.dev/v1alpha1"
CONTAINER = {"name": "main", "image": "example.invalid/workload:1"}
STEP_SECONDS = 0.2  # the simulated trainer's compute per step
# A TrainingJob's container under ``matrixpool sim``: the matrixpool image's simulated trainer,
# which the sim's process kubelet runs with the pod's env (kwok only marks other images Running).
TRAINER = trainer.container(STEP_SECONDS)


class Manifest:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def yaml(self) -> str:
        return json.dumps(self.body)  # JSON is YAML; kubectl takes either


class SuperNodeManifest(Manifest):
    def spares(self, nodes: int) -> SuperNodeManifest:
        self.body["spec"]["spares"] = {"nodes": nodes}
        return self


def supernode(name: str, label: str | None = None, spares: int = 1) -> SuperNodeManifest:
    return SuperNodeManifest(
        {
            "apiVersion": API,
            "kind": "SuperNode",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": label or name}},
                "cardResource": "huawei.com/Ascend910",
                "cardsPerNode": 8,
                "topologyKeys": ["matrixpool.dev/rack"],
                "spares": {"nodes": spares},
            },
        }
    )


class TrainingJobManifest(Manifest):
    def replicas(self, count: int, minimum: int | None = None) -> TrainingJobManifest:
        self.body["spec"]["replicas"] = count
        if minimum is not None:
            self.body["spec"]["minReplicas"] = minimum
        return self

    def cards(self, per_replica: int) -> TrainingJobManifest:
        self.body["spec"]["cardsPerReplica"] = per_replica
        return self

    def on(self, supernode: str | None, affinity: str = "Required") -> TrainingJobManifest:
        if supernode:
            self.body["spec"]["superNode"] = supernode
        self.body["spec"]["placement"] = {"superNodeAffinity": affinity}
        return self

    def priority(self, value: int) -> TrainingJobManifest:
        self.body["spec"]["priority"] = value
        return self

    def trainer(self, step_seconds: float = STEP_SECONDS, **env: str) -> TrainingJobManifest:
        """Its pods run the simulated trainer at ``step_seconds`` per step, with ``env``."""
        self.body["spec"]["template"]["spec"]["containers"] = [
            trainer.container(step_seconds, **env)
        ]
        return self


def training_job(name: str) -> TrainingJobManifest:
    return TrainingJobManifest(
        {
            "apiVersion": API,
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "replicas": 1,
                "cardsPerReplica": 8,
                "template": {"spec": {"containers": [copy.deepcopy(TRAINER)]}},
            },
        }
    )


class InferenceManifest(Manifest):
    def role(
        self,
        name: str,
        replicas: int,
        pods: int = 1,
        cards: int = 8,
        experts: tuple[int, int] | None = None,
    ) -> InferenceManifest:
        role: dict[str, Any] = {
            "name": name,
            "replicas": replicas,
            "podsPerReplica": pods,
            "cardsPerPod": cards,
            "template": {"spec": {"containers": [copy.deepcopy(CONTAINER)]}},
        }
        if experts:
            role["expertParallel"] = {"experts": experts[0], "redundantExperts": experts[1]}
        self.body["spec"]["roles"].append(role)
        return self

    def priority(self, value: int) -> InferenceManifest:
        self.body["spec"]["priority"] = value
        return self


def inference_service(name: str, supernode: str) -> InferenceManifest:
    return InferenceManifest(
        {
            "apiVersion": API,
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": {"superNode": supernode, "roles": []},
        }
    )
