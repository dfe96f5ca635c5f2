#!/usr/bin/env bash
# Runs the test suite with the engines' files kept in a private folder that is removed afterwards.
# Arguments are passed to pytest. Exits non-zero when a test fails or when no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${PWD}/.test-tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work/tmp" VLLM_CACHE_ROOT="$work/vllm-cache" VLLM_RPC_BASE_PATH="$work/rpc" \
  XDG_CACHE_HOME="$work/xdg-cache" PDSERVE_CACHE="${PDSERVE_CACHE:-$PWD/.cache}" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu \
  PYTHONDONTWRITEBYTECODE=1
mkdir -p "$TMPDIR" "$VLLM_CACHE_ROOT" "$VLLM_RPC_BASE_PATH" "$XDG_CACHE_HOME"
# The dashboard test drives a real headless browser (Debian's chromium).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
    || echo "test.sh: could not install chromium; the browser test will fail" >&2
fi
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "test.sh: no test ran" >&2
  exit 1
fi
exit $rc
