#!/usr/bin/env bash
# Configures (once) and builds memoffload into build/ (Release by default).
# Usage: scripts/build.sh [extra cmake -D options]; BUILD_DIR overrides build/,
# BUILD_TARGETS="a b" builds only those targets.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
jobs=$(nproc)
launcher=()
# ccache (installed by setup-deps.sh) makes a rebuild in a fresh clone cheap.
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
generator=()
if command -v ninja >/dev/null && [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then generator=(-G Ninja); fi
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" || $# -gt 0 ]]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >/dev/null
fi
targets=()
if [[ -n "${BUILD_TARGETS:-}" ]]; then read -ra targets <<<"--target $BUILD_TARGETS"; fi
cmake --build "$BUILD_DIR" -j "$jobs" "${targets[@]}"
