"""The workload model: a TrainingJob or InferenceService as every controller reads it
(:class:`Workload`), parsed from its body once per generation by :func:`parse`.

Filled by the kopf indexes (:mod:`matrixpool.state.indexes`); read through the
:class:`~matrixpool.state.world.World`. Nothing here writes to the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import pydantic

from matrixpool import api
from matrixpool.api import common, inferenceservice, trainingjob


@dataclass(frozen=True)
class Workload:
    """A TrainingJob or InferenceService as the scheduler needs it."""

    kind: str
    namespace: str
    name: str
    uid: str
    created: str  # metadata.creationTimestamp, for first-come order among equal priorities
    generation: int | None
    model: trainingjob.TrainingJob | inferenceservice.InferenceService | None
    error: str | None  # why the body did not parse (the CRD should make this impossible)
    status: Mapping[str, Any]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def served_spec(self) -> inferenceservice.InferenceServiceSpec:
        """An InferenceService's spec as served now: with autoscaling in Auto mode, the replicas
        of its status.recommendation (:func:`matrixpool.api.inferenceservice.scaled`)."""
        assert isinstance(self.model, inferenceservice.InferenceService)
        spec = self.model.spec
        if spec.autoscaling is None or not self.status.get("recommendation"):
            return spec
        advice = {"recommendation": self.status["recommendation"]}
        try:
            status = inferenceservice.parse_status(advice)
        except pydantic.ValidationError:  # written by someone else: serve the spec as written
            return spec
        return inferenceservice.scaled(spec, status)

    def experts(self) -> dict[str, inferenceservice.ExpertsStatus]:
        """An InferenceService's ``status.experts`` by role: the measured expert load and the
        layout of the expert map in force (:mod:`matrixpool.controllers.experts`); empty when
        there is none, or it does not parse (written by someone else)."""
        try:
            status = inferenceservice.parse_status({"experts": self.status.get("experts") or []})
        except pydantic.ValidationError:
            return {}
        return {e.role: e for e in status.experts}

    @property
    def ref(self) -> dict[str, Any]:
        """Enough of the object for kopf.event() and ownerReferences."""
        return {
            "apiVersion": api.API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
        }


PARSED = "matrixpool.parsed"  # the per-object kopf memo's key: ((uid, generation), model, error)


def parse(
    kind: str, body: kopf.Body, model_of: Any, memo: Any | None = None
) -> dict[str, Workload]:
    """The Workload of ``body``. Its spec is parsed once per generation (kept in the object's
    kopf memo): the status patches the operator writes every few seconds each come back as an
    event, and validating the whole spec again for each was a tenth of the operator's time
    at 512 jobs. ``model`` carries the spec; the status is ``Workload.status``, always current."""
    meta = body.get("metadata") or {}
    identity = (meta.get("uid", ""), meta.get("generation"))
    cached = memo.get(PARSED) if memo is not None else None
    if cached is not None and cached[0] == identity:
        model, error = cached[1], cached[2]
    else:
        spec_only = {k: v for k, v in body.items() if k != "status"}
        try:
            model, error = model_of(common.plain(spec_only)), None
        except pydantic.ValidationError as failure:
            model, error = None, str(failure)
        if memo is not None:
            memo[PARSED] = (identity, model, error)
    workload = Workload(
        kind=kind,
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        created=meta.get("creationTimestamp", ""),
        generation=meta.get("generation"),
        model=model,
        error=error,
        status=common.plain(body.get("status") or {}),
    )
    return {workload.key: workload}
