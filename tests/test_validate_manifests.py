"""scripts/validate_manifests.py, the manifest checker, on small inline manifests (no kustomize:
tests/test_deploy.py runs it on the real ones through scripts/validate-manifests.sh)."""

from __future__ import annotations

import copy
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest
import validate_manifests as vm
import yaml

LABELS = {"app": "pdserve", "component": "decode"}


def deployment() -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "pdserve-decode", "labels": dict(LABELS)},
        "spec": {
            "selector": {"matchLabels": dict(LABELS)},
            "template": {
                "metadata": {"labels": dict(LABELS)},
                "spec": {
                    "volumes": [{"name": "keys", "secret": {"secretName": "k"}}],
                    "containers": [{
                        "name": "w", "image": "pdserve:1",
                        "args": ["worker", "--role", "decode", "--advertise-host",
                                 "$(POD_IP)"],
                        "env": [{"name": "POD_IP",
                                 "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                        "envFrom": [{"configMapRef": {"name": "env"}}],
                        "ports": [{"name": "health", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "health"}},
                        "volumeMounts": [{"name": "keys", "mountPath": "/keys"}],
                        "resources": {"requests": {"cpu": "2", "memory": "8Gi",
                                                   "nvidia.com/gpu": 1},
                                      "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}},
                    }],
                },
            },
        },
    }


def others() -> list[dict]:
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "env"},
         "data": {"UCX_TLS": "tcp"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "pdserve-decode"},
         "spec": {"selector": dict(LABELS), "ports": [{"port": 80, "targetPort": "health"}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "pdb"},
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(LABELS)}}},
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
         "metadata": {"name": "hpa"},
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "pdserve-decode"},
                  "minReplicas": 1, "maxReplicas": 4,
                  "metrics": [
                      {"type": "External", "external": {
                          "metric": {"name": "pdserve_planner_desired_workers",
                                     "selector": {"matchLabels": {"role": "decode"}}},
                          "target": {"type": "AverageValue", "averageValue": "1"}}},
                      {"type": "External", "external": {
                          "metric": {"name": "pdserve_worker_waiting_requests",
                                     "selector": {"matchLabels": {"role": "decode"}}},
                          "target": {"type": "AverageValue", "averageValue": "2"}}}]}},
    ]


def rule(series: str, query: str = "sum(<<.Series>>{<<.LabelMatchers>>})", **name) -> dict:
    return {"seriesQuery": f'{series}{{namespace!="",role!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
            "name": name or {"matches": f"^{series}$", "as": series}, "metricsQuery": query}


def adapter() -> dict:
    """prometheus-adapter Helm values serving the HPA's metrics, as the example overlay's."""
    return {"rules": {"default": False, "external": [
        rule("pdserve_planner_desired_workers"),
        rule("pdserve_worker_waiting_requests",
             "sum(max by (worker) (<<.Series>>{<<.LabelMatchers>>}))")]}}


def manifests() -> list[dict]:
    return [deployment(), *others()]


def container(resources: list[dict]) -> dict:
    return resources[0]["spec"]["template"]["spec"]["containers"][0]


def test_a_consistent_set_has_no_errors(tmp_path) -> None:
    assert vm.semantic_errors(manifests()) == []
    assert vm.semantic_errors(manifests(), adapter()) == []
    assert vm.check(yaml.safe_dump_all(manifests()), ["1.30"])[1] == []
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(adapter()))
    assert vm.check(yaml.safe_dump_all(manifests()), ["1.30"], values)[1] == []


def broken(change) -> list[str]:
    res = copy.deepcopy(manifests())
    change(res)
    return vm.semantic_errors(res)


@pytest.mark.parametrize("change, message", [
    (lambda r: r[0]["spec"]["selector"]["matchLabels"].update(component="prefill"),
     "spec.selector does not match"),
    (lambda r: container(r)["env"].clear(), "refers to $(POD_IP)"),
    (lambda r: container(r)["resources"]["requests"].update(memory="8 GB"), "not a quantity"),
    (lambda r: container(r)["resources"]["limits"].update({"nvidia.com/gpu": 2}),
     "needs limits equal to requests"),
    (lambda r: container(r)["volumeMounts"][0].update(name="nokeys"), "has no volume"),
    (lambda r: container(r)["readinessProbe"]["httpGet"].update(port="http"),
     "not a port of the container"),
    (lambda r: r[1]["metadata"].update(name="other-env"), "envFrom ConfigMap env"),
    (lambda r: r[2]["spec"]["ports"][0].update(targetPort="http"), "no named port"),
    (lambda r: r[2]["spec"]["selector"].update(app="other"), "matches no pod template"),
    (lambda r: r[3]["spec"]["selector"]["matchLabels"].update(app="x"), "matches 0 workloads"),
    (lambda r: r[4]["spec"]["scaleTargetRef"].update(name="pdserve-decoder"), "scaleTargetRef"),
    (lambda r: r[4]["spec"].update(minReplicas=5), "minReplicas > maxReplicas"),
    (lambda r: r.append(copy.deepcopy(r[1])), "defined twice"),
    (lambda r: r[0]["metadata"].update(name="PDserve"), "not a DNS-1123"),
    (lambda r: r[0]["metadata"]["labels"].update(app="-x"), "not a valid label value"),
    (lambda r: r[0]["spec"].update(strategy={"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": 0, "maxUnavailable": "0%"}}), "maxSurge and maxUnavailable both 0"),
    (lambda r: r[3]["spec"].update(maxUnavailable=0), "allows no eviction (maxUnavailable 0)"),
    # The HPA may scale the Deployment down to its minReplicas (1).
    (lambda r: (r[0]["spec"].update(replicas=3), r[3]["spec"].pop("maxUnavailable"),
                r[3]["spec"].update(minAvailable=1)),
     "allows no eviction (minAvailable 1 with 1 replica(s))"),
])
def test_each_inconsistency_is_named(change, message) -> None:
    errors = broken(change)
    assert any(message in e for e in errors), errors


def hpa_metric(res: list[dict], i: int = 0) -> dict:
    return res[4]["spec"]["metrics"][i]["external"]


def broken_autoscaling(change) -> list[str]:
    """The errors of the manifests and adapter values after `change(resources, values)`."""
    res, values = manifests(), adapter()
    change(res, values)
    return vm.semantic_errors(res, values)


@pytest.mark.parametrize("change, message", [
    # An HPA names a metric no rule serves (a misspelling, a rule dropped or renamed).
    (lambda r, a: hpa_metric(r, 1)["metric"].update(name="pdserve_worker_queued_requests"),
     "External metric pdserve_worker_queued_requests is served by no external rule"),
    (lambda r, a: a["rules"]["external"].pop(0),
     "External metric pdserve_planner_desired_workers is served by no external rule"),
    (lambda r, a: a["rules"]["external"][0]["name"].update({"as": "pdserve_planner_desired"}),
     "pdserve_planner_desired_workers is served by no external rule"),
    (lambda r, a: r[4]["spec"]["metrics"].append({"type": "Pods", "pods": {
        "metric": {"name": "requests"}, "target": {"type": "AverageValue",
                                                   "averageValue": "1"}}}),
     "Pods metric requests is served by no custom rule"),
    # The workers are scaled on something else than the planner's count for their role.
    (lambda r, a: r[4]["spec"]["metrics"].pop(0),
     "scales decode workers but not on pdserve_planner_desired_workers{role=decode}"),
    (lambda r, a: hpa_metric(r)["metric"]["selector"]["matchLabels"].update(role="prefill"),
     "not on pdserve_planner_desired_workers{role=decode}, the role planner's count of the "
     "workers they need (it selects role prefill)"),
    (lambda r, a: container(r)["args"].__setitem__(2, "auto"),
     "scales auto workers but not on pdserve_planner_desired_workers{role=both}"),
    (lambda r, a: hpa_metric(r).update(target={"type": "Value", "value": "1"}),
     "needs an AverageValue target"),
    # Rules that would not serve what the HPA asks for.
    (lambda r, a: a["rules"]["external"][0].update(metricsQuery="sum(<<.Series>>)"),
     "rules.external[0]: metricsQuery has no <<.LabelMatchers>>"),
    (lambda r, a: a["rules"]["external"][0].update(metricsQuery="sum(x)"),
     "rules.external[0]: metricsQuery does not use <<.Series>>"),
    (lambda r, a: a["rules"]["external"][0].pop("resources"),
     "rules.external[0]: no resources mapping"),
    (lambda r, a: a["rules"]["external"][0]["name"].update(matches="^pdserve_desired$"),
     "does not match the series pdserve_planner_desired_workers"),
    (lambda r, a: a["rules"]["external"][1]["name"].update(matches="(", **{"as": "x"}),
     "rules.external[1]: name.matches is not a regular expression"),
    (lambda r, a: a["rules"]["external"].append(rule("pdserve_planner_desired_workers")),
     "rules.external[2]: pdserve_planner_desired_workers is served by an earlier rule"),
    (lambda r, a: a.pop("rules"), "prometheus-adapter values: no rules"),
])
def test_each_autoscaling_inconsistency_is_named(change, message) -> None:
    errors = broken_autoscaling(change)
    assert any(message in e for e in errors), errors


def test_an_auto_worker_pool_scales_on_the_count_of_colocated_workers() -> None:
    res, values = manifests(), adapter()
    container(res)["args"][2] = "auto"
    hpa_metric(res)["metric"]["selector"]["matchLabels"]["role"] = "both"
    assert vm.semantic_errors(res, values) == []
    assert vm.worker_role(res[0]) == "auto"
    container(res)["args"][1:3] = ["--role=prefill"]
    assert vm.worker_role(res[0]) == "prefill"
    container(res)["args"][0] = "controller"  # not a worker: no planner metric asked for
    assert vm.worker_role(res[0]) is None
    res[4]["spec"]["metrics"].pop(0)
    assert vm.semantic_errors(res, values) == []


def test_adapter_rules_name_their_metrics_as_prometheus_adapter_does() -> None:
    rules = [
        rule("a_total", **{"matches": "^(.*)_total$", "as": "${1}_per_second"}),
        rule("b_seconds_total", matches="^(.*)_total$"),  # one group, no `as`: $1
        rule("c_bytes", matches="^c_(.*)$", **{"as": "$0"}),
        rule("d_ratio"),  # no name section: the series' own name
        {**rule("e"), "seriesQuery": '{__name__=~"^e_.*"}',
         "name": {"as": "$1", "matches": "(.*)"}},
    ]
    rules[3].pop("name")
    served, errors = vm.adapter_metrics({"rules": {"default": False, "external": rules}})
    assert errors == []
    # The regex-selected series has no name to expand a template on: not known statically.
    assert served == {"external": {"a_per_second", "b_seconds", "c_bytes", "d_ratio"},
                      "custom": set()}
    # With the chart's default rules on, the custom metrics it serves are not known.
    assert vm.adapter_metrics({"rules": {"external": []}})[0]["custom"] is None


def test_the_command_checks_hpas_against_the_adapter_values(tmp_path, capsys) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all(manifests()))
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(adapter()))
    assert vm.main([str(good), "-k", "1.34", "--adapter-values", str(values)]) == 0
    assert "HPA metrics served by values.yaml" in capsys.readouterr().out
    values.write_text(yaml.safe_dump({"rules": {"default": False, "external": [
        rule("pdserve_planner_desired_workers")]}}))
    assert vm.main([str(good), "-k", "1.34", "-q", "--adapter-values", str(values)]) == 1
    assert "pdserve_worker_waiting_requests is served by no external rule" in \
        capsys.readouterr().out
    values.write_text("rules: [")
    assert vm.main([str(good), "-k", "1.34", "-q", "--adapter-values", str(values)]) == 1
    assert "cannot be read" in capsys.readouterr().out
    # In a kustomization directory, prometheus-adapter-values.yaml beside it is found.
    assert vm.adapter_values_for(tmp_path, None) is None
    (tmp_path / vm.ADAPTER_VALUES).write_text("")
    assert vm.adapter_values_for(tmp_path, None) == tmp_path / vm.ADAPTER_VALUES
    assert vm.adapter_values_for(good, None) is None
    assert vm.adapter_values_for(tmp_path, values) == values


def test_a_budget_that_leaves_room_for_a_drain_passes() -> None:
    res = manifests()
    res[0]["spec"].update(replicas=2, strategy={"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": 1, "maxUnavailable": 0}})
    res[3]["spec"] = {"minAvailable": 1, "selector": res[3]["spec"]["selector"]}
    res[4]["spec"]["minReplicas"] = 2
    assert vm.semantic_errors(res) == []
    res[3]["spec"]["minAvailable"] = "50%"  # percentages are not judged
    res[4]["spec"]["minReplicas"] = 1
    assert vm.semantic_errors(res) == []


def test_label_selectors_follow_kubernetes() -> None:
    labels = {"a": "1", "b": "2"}
    assert vm.matches({"matchLabels": {"a": "1"}}, labels)
    assert not vm.matches({}, labels) and not vm.matches(None, labels)
    expr = [({"operator": "In", "key": "a", "values": ["1", "3"]}, True),
            ({"operator": "NotIn", "key": "a", "values": ["1"]}, False),
            ({"operator": "Exists", "key": "c"}, False),
            ({"operator": "DoesNotExist", "key": "c"}, True)]
    for e, want in expr:
        assert vm.matches({"matchExpressions": [e]}, labels) is want, e


def test_schemas_are_strict() -> None:
    d = deployment()
    container([d])["readinessProbes"] = {}
    errors = vm.schema_errors(d, ["1.30", "1.34"])
    assert len(errors) == 2 and all("readinessProbes" in e for e in errors)
    assert "no schema" in vm.schema_errors({**d, "kind": "Deploymnt"}, ["1.34"])[0]
    assert "without apiVersion/kind" in vm.schema_errors({"kind": "X"}, ["1.34"])[0]
    with pytest.raises(vm.VersionNotSupported):
        vm.schema_errors(d, ["9.99"])


def test_the_command_on_rendered_files(tmp_path, capsys) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all(manifests()))
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump_all(broken_set()))
    out = tmp_path / "out"
    assert vm.main([str(good), "-o", str(out), "-k", "1.34"]) == 0
    o = capsys.readouterr()
    assert "ok   " in o.out and "all 1 target(s) valid" in o.err
    assert yaml.safe_load_all((out / "good.yaml").read_text())
    assert vm.main([str(good), str(bad), str(tmp_path / "missing"), "-q"]) == 1
    o = capsys.readouterr()
    assert "ok   " not in o.out and f"FAIL {bad}: 1 error(s)" in o.out
    assert "scaleTargetRef" in o.out and "no such kustomization" in o.err
    assert "FAILED" in o.err
    assert vm.main([str(good), "-k", "9.99"]) == 2


def broken_set() -> list[dict]:
    res = manifests()
    res[4]["spec"]["scaleTargetRef"]["name"] = "elsewhere"
    return res


def test_default_targets_are_the_base_and_each_overlay() -> None:
    names = [vm.target_name(t) for t in vm.default_targets()]
    assert names[0] == "base" and "example" in names


def fake_wheel(folder: Path, kubectl: bytes) -> str:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr("kubectl/kubectl", kubectl)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    whl = folder / "layer-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("layer/_jsii/layer@1.0.jsii.tgz", tgz.getvalue())
    return hashlib.sha256(whl.read_bytes()).hexdigest()


def test_kubectl_comes_out_of_the_wheel_only_with_the_pinned_hash(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    sha = fake_wheel(wheels, b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="expected 00"):
        vm.unpack_kubectl(wheels, tmp_path / "bin", "00")
    assert not (tmp_path / "bin" / "kubectl").exists()
    assert vm.main(["unpack-kubectl", str(wheels), str(tmp_path / "bin"), sha]) == 0
    kubectl = tmp_path / "bin" / "kubectl"
    assert kubectl.read_bytes() == b"#!/bin/sh\n" and kubectl.stat().st_mode & 0o111
