#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test suite. Exits non-zero
# on any failure. Extra arguments go to ctest (e.g. -L unit, -R integration).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh
scripts/build.sh
export MEMOFFLOAD_BIN_DIR="$PWD/build/bin"

# Every suite (C++ unit and integration, Python torch tests, deploy checks,
# metrics end-to-end) is registered with CTest, so its summary is the one to read.
cd build
exec ctest --output-on-failure --timeout 900 "$@"
