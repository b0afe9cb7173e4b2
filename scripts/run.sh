#!/usr/bin/env bash
# Installs what is missing, builds, and runs memoffloadd in the foreground
# with embedded defaults. Extra arguments go to memoffloadd (see --help).
#   scripts/run.sh                      # default arena and runtime dir
#   scripts/run.sh --arena-size 8GiB    # any daemon flag
#   scripts/run.sh --demo               # daemon + a small CPU training demo
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh
BUILD_TARGETS="memoffloadd memoffloadctl" scripts/build.sh >/dev/null
echo "run.sh: built build/bin/memoffloadd"

if [[ "${1:-}" == "--demo" ]]; then
  shift
  # The trainer side: .venv with torch and the memoffload package (pip).
  MEMOFFLOAD_PYTHON=$(scripts/venv.sh | tail -n 1)
  export MEMOFFLOAD_PYTHON
  exec scripts/demo.sh "$@"
fi
exec build/bin/memoffloadd "$@"
