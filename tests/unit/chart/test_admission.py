"""The chart's ValidatingAdmissionPolicy on pods (``podAnnotationsPolicy`` values), rendered
with helm: only the operator's ServiceAccount (plus ``extraUsernames``) may set, change or remove
``matrixpool.dev/*`` pod annotations, on every path that writes a pod's annotations (create,
update, status, bindings). The dev cluster installs the same template with its admin user
allowed. What the policy admits or denies is tested on the real API server in
tests/integration/test_admission.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from matrixpool import api
from matrixpool.api import labels
from matrixpool.devcluster import certs, cluster
from tests.unit.chart import test_chart as chart

Manifest = dict[str, Any]
OPERATOR = f"system:serviceaccount:{chart.NAMESPACE}:{chart.RELEASE}-matrixpool"


def policy(manifests: list[Manifest], kind: str = "ValidatingAdmissionPolicy") -> Manifest:
    """The pod-annotations policy (or its binding) among the chart's admission policies."""
    [found] = [
        m
        for m in manifests
        if m["kind"] == kind and m["metadata"]["name"].endswith("-pod-annotations")
    ]
    return found


def writers(policy: Manifest) -> list[str]:
    """The user names the policy's match condition exempts."""
    [condition] = policy["spec"]["matchConditions"]
    found = re.fullmatch(r"!\(request\.userInfo\.username in (\[.*\])\)", condition["expression"])
    assert found, condition["expression"]
    names: list[str] = json.loads(found[1])
    return names


def test_the_policy_and_its_binding_are_on_by_default(helm: chart.Helm) -> None:
    manifests = helm.render()
    rendered = policy(manifests)
    binding = policy(manifests, "ValidatingAdmissionPolicyBinding")
    assert rendered["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert chart.RELEASE in rendered["metadata"]["name"]
    assert binding["spec"] == {
        "policyName": rendered["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert rendered["spec"]["failurePolicy"] == "Fail"


def test_only_the_operator_service_account_writes_the_annotations(helm: chart.Helm) -> None:
    manifests = helm.render()
    account = chart.operators(manifests, "ServiceAccount")["metadata"]["name"]
    assert writers(policy(manifests)) == [f"system:serviceaccount:{chart.NAMESPACE}:{account}"]
    assert writers(policy(manifests)) == [OPERATOR]


def test_further_writers_and_an_existing_service_account_follow_the_values(
    helm: chart.Helm,
) -> None:
    rendered = policy(
        helm.render(
            "serviceAccount.create=false",
            "serviceAccount.name=ops",
            "podAnnotationsPolicy.extraUsernames[0]=break-glass",
        )
    )
    assert writers(rendered) == [f"system:serviceaccount:{chart.NAMESPACE}:ops", "break-glass"]


def test_every_path_that_writes_pod_annotations_is_matched(helm: chart.Helm) -> None:
    [rule] = policy(helm.render())["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [""]
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    assert {"pods", "pods/status", "pods/binding", "bindings"} <= set(rule["resources"])


def test_the_rules_guard_the_prefix_of_the_annotation_contract(helm: chart.Helm) -> None:
    spec = policy(helm.render())["spec"]
    prefix = {v["name"]: v["expression"] for v in spec["variables"]}["prefix"]
    assert prefix == f"'{api.GROUP}/'"
    for key in (labels.CARDS, labels.RESTORE, labels.CHECKPOINT_REQUEST):
        assert key.startswith(api.GROUP + "/")
    assert len(spec["validations"]) == 4  # set and removed: annotations, then labels
    kinds = ["annotations"] * 2 + ["labels"] * 2
    for validation, what in zip(spec["validations"], kinds, strict=True):
        assert "variables.prefix" in validation["expression"]
        assert f"metadata.{what}" in validation["expression"]
        assert validation["message"].startswith(f"matrixpool.dev/* pod {what} are")
        assert validation["reason"] == "Forbidden"


def test_the_policy_can_be_left_out(helm: chart.Helm) -> None:
    manifests = helm.render(
        "podAnnotationsPolicy.enabled=false",
        "configMapPolicy.enabled=false",
        "daemonLeasePolicy.enabled=false",  # the daemons' Lease policy, on with the daemons
    )
    assert not chart.kinds(manifests) & {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }


def test_the_configmap_policy_binds_the_operator_outside_its_namespace(helm: chart.Helm) -> None:
    [rendered] = [
        m
        for m in helm.render()
        if m["kind"] == "ValidatingAdmissionPolicy"
        and m["metadata"]["name"].endswith("-configmaps")
    ]
    conditions = {c["name"]: c["expression"] for c in rendered["spec"]["matchConditions"]}
    assert conditions == {
        "the-operator": f'request.userInfo.username == "{OPERATOR}"',
        "outside-the-release-namespace": f'request.namespace != "{chart.NAMESPACE}"',
    }
    names = rendered["spec"]["validations"][0]["expression"]
    assert f"'{labels.RANK_TABLE_PREFIX}'" in names
    assert "'-expert-map'" in names


def test_the_chart_rejects_an_empty_writer_name(helm: chart.Helm) -> None:
    result = helm.template("podAnnotationsPolicy.extraUsernames[0]=")
    assert result.returncode != 0, result.stdout[:400]
    assert "extraUsernames" in result.stderr


def test_the_dev_cluster_installs_the_same_template_with_its_admin_user(
    helm: chart.Helm, tmp_path: Path
) -> None:
    documents = [
        d for d in yaml.safe_load_all(cluster.admission_policy(helm.path.parent, tmp_path)) if d
    ]
    assert {d["kind"] for d in documents} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    rendered = policy(documents)
    assert certs.ADMIN_USER in writers(rendered)
    chart_spec = policy(helm.render())["spec"]
    assert rendered["spec"]["validations"] == chart_spec["validations"]
    assert rendered["spec"]["matchConstraints"] == chart_spec["matchConstraints"]
