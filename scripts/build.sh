#!/usr/bin/env bash
# Configures (once) and builds memoffload into build/ (Release by default).
# Usage: scripts/build.sh [extra cmake -D options]; BUILD_DIR overrides build/.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
jobs=$(nproc)
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" || $# -gt 0 ]]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$jobs"
