#!/usr/bin/env bash
# Runs the test suite with the engines' files kept in a private folder that is removed afterwards.
# Arguments are passed to pytest. Exits non-zero when mypy finds a type error in pdserve/, when a
# test fails or when no test ran.
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
# The type checker runs with the suite (`make test`, `make test-fast`); a run of chosen test files
# (a path or node id among the arguments) skips it.
chosen=0
for arg in "$@"; do
  [ -e "${arg%%::*}" ] && chosen=1
done
typed=0
if [ "$chosen" = 0 ]; then
  .venv/bin/python -m mypy || typed=1
fi
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "test.sh: no test ran" >&2
  exit 1
fi
if [ $typed -ne 0 ]; then
  echo "test.sh: mypy found type errors (above; configured in pyproject.toml)" >&2
  [ $rc -ne 0 ] || rc=1
fi
exit $rc
