"""From workload specs to gangs: which pods a TrainingJob or an InferenceService needs, grouped
into the :class:`~matrixpool.placement.model.GangRequest` objects the engine places.

Pure (no kopf, no Kubernetes client). The scheduler cycle (``matrixpool.controllers.scheduling``)
calls it every cycle; pods are named here so that the names are stable across operator restarts.

Rules:
- A TrainingJob is one gang of ``replicas`` ranks. A replica asking more cards than a node has is
  split into whole-node pods (``cardsPerReplica`` must then be a multiple of the node size).
- An InferenceService is one gang per (role, replica): ``podsPerReplica`` pods of
  ``cardsPerPod`` cards; replicas of one role spread across racks.
- Every pod of a gang asks of its node what its pod template asks besides cards (resources,
  tolerations, nodeSelector, required node affinity: :func:`nodefit.needs_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matrixpool.api import inferenceservice, trainingjob
from matrixpool.placement import eplb, model, nodefit

TRAINER_ROLE = "trainer"


@dataclass(frozen=True)
class PodPlan:
    """One pod the operator must keep in existence for a gang."""

    namespace: str
    name: str
    gang: model.GangKey
    owner: str  # name of the TrainingJob or InferenceService
    kind: str  # TrainingJob | InferenceService
    role: str  # "trainer" for training
    replica: int  # training: the replica index; inference: the instance index
    rank: int  # rank within the gang
    cards: int

    @property
    def key(self) -> model.PodKey:
        return model.PodKey(f"{self.namespace}/{self.name}")


@dataclass(frozen=True)
class Gang:
    """A gang request together with the pods that make it up (same order)."""

    request: model.GangRequest
    pods: tuple[PodPlan, ...]
    owner: str
    kind: str
    role: str


def pods_per_replica(cards_per_replica: int, cards_per_node: int | None) -> tuple[int, int]:
    """(pods per replica, cards per pod): a replica bigger than a node becomes whole-node pods.

    A size that is not a multiple of the node is left as one pod; check_servable reports it.
    """
    if (
        cards_per_node
        and cards_per_replica > cards_per_node
        and (cards_per_replica % cards_per_node == 0)
    ):
        return cards_per_replica // cards_per_node, cards_per_node
    return 1, cards_per_replica


def training_gang(
    namespace: str,
    name: str,
    spec: trainingjob.TrainingJobSpec,
    cards_per_node: int | None,
    replicas: int | None = None,
    card_resource: str = "",
) -> Gang:
    """The gang of a TrainingJob running ``replicas`` (default: spec.replicas) ranks;
    ``card_resource`` is left out of what its template asks of nodes."""
    count = spec.replicas if replicas is None else replicas
    per_replica, cards = pods_per_replica(spec.cards_per_replica, cards_per_node)
    key = model.GangKey(f"{namespace}/{name}")
    pods = tuple(
        PodPlan(
            namespace,
            f"{name}-{rank}",
            key,
            name,
            trainingjob.KIND,
            TRAINER_ROLE,
            rank // per_replica,
            rank,
            cards,
        )
        for rank in range(count * per_replica)
    )
    group = spec.placement.group_size
    request = model.GangRequest(
        gang=key,
        pods=tuple(model.PodRequest(p.key, p.cards) for p in pods),
        priority=spec.priority,
        supernode=spec.super_node,
        affinity=model.Affinity(spec.placement.super_node_affinity.value),
        group_size=group * per_replica if group else None,
        min_pods=spec.min_replicas * per_replica,
        needs=nodefit.needs_of(spec.template, card_resource),
    )
    return Gang(request, pods, name, trainingjob.KIND, TRAINER_ROLE)


def inference_gangs(
    namespace: str,
    name: str,
    spec: inferenceservice.InferenceServiceSpec,
    replicas: Mapping[str, int] | None = None,
    card_resource: str = "",
) -> list[Gang]:
    """One gang per (role, replica); ``replicas`` overrides a role's count (time-sharing)."""
    gangs = []
    for role in spec.roles:
        needs = nodefit.needs_of(role.template, card_resource)
        count = role.replicas if replicas is None else replicas.get(role.name, role.replicas)
        for replica in range(count):
            key = model.GangKey(f"{namespace}/{name}/{role.name}/{replica}")
            pods = tuple(
                PodPlan(
                    namespace,
                    f"{name}-{role.name}-{replica}-{index}",
                    key,
                    name,
                    inferenceservice.KIND,
                    role.name,
                    replica,
                    index,
                    role.cards_per_pod,
                )
                for index in range(role.pods_per_replica)
            )
            request = model.GangRequest(
                gang=key,
                pods=tuple(model.PodRequest(p.key, p.cards) for p in pods),
                priority=spec.priority,
                supernode=spec.super_node,
                affinity=model.Affinity.REQUIRED,
                spread_group=f"{namespace}/{name}/{role.name}",
                preemptible=True,
                cards_field=f"spec.roles[{role.name}].cardsPerPod",
                needs=needs,
            )
            gangs.append(Gang(request, pods, name, inferenceservice.KIND, role.name))
    return gangs


def expert_map(
    role: inferenceservice.Role,
    assignments: Mapping[str, tuple[int, ...]],
    pod_names: list[str],
    layout: Sequence[int] | None = None,
) -> list[dict[str, object]]:
    """Expert id → (pod, card) for one expert-parallel replica: every card exactly once.

    ``assignments`` maps pod name → its bound cards; slots are the cards in rank order.
    ``layout`` (slot → expert, :mod:`matrixpool.placement.eplb`) says which expert each slot
    holds; without one (or one that does not fit the role), the first ``experts`` slots hold the
    experts in order and the rest copies of experts 0, 1, 2...
    """
    assert role.expert_parallel is not None
    slots = [(pod, card) for pod in pod_names for card in assignments[pod]]
    experts = role.expert_parallel.experts
    total = experts + role.expert_parallel.redundant_experts
    if len(slots) != total:
        raise ValueError(f"{len(slots)} cards bound for {total} experts of role {role.name}")
    if layout is None or not eplb.valid(layout, experts, total):
        layout = eplb.default_layout(experts, total)
    return [
        {"expert": i, "copyOf": layout[i], "pod": pod, "card": card}
        for i, (pod, card) in enumerate(slots)
    ]
