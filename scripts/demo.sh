#!/usr/bin/env bash
# What `scripts/run.sh --demo` runs: starts memoffloadd with embedded defaults
# in a private runtime dir, trains a small Transformer on CPU with offload
# through it (scripts/demo.py), then stops the daemon. Expects a built tree:
# $MEMOFFLOAD_BIN_DIR (default build/bin) and $MEMOFFLOAD_PYTHON (default
# .venv/bin/python, where scripts/venv.sh installed torch and memoffload).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${MEMOFFLOAD_BIN_DIR:-build/bin}
python=${MEMOFFLOAD_PYTHON:-.venv/bin/python}
dir=$(mktemp -d /tmp/memoffload-demo-XXXXXX)
log="$dir/memoffloadd.log"
"$bin/memoffloadd" --runtime-dir "$dir/run" --metrics-address none >"$log" 2>&1 &
daemon=$!
cleanup() {
  kill -INT "$daemon" 2>/dev/null || true
  wait "$daemon" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 1 300); do
  if "$bin/memoffloadctl" --runtime-dir "$dir/run" status >/dev/null 2>&1; then break; fi
  if ! kill -0 "$daemon" 2>/dev/null; then
    echo "demo: memoffloadd failed to start:" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 0.1
done
grep -E "arena ready|listening" "$log" | sed 's/^/  /'
"$python" scripts/demo.py --runtime-dir "$dir/run" "$@"
