#!/usr/bin/env bash
# Builds the GPU kit: one folder that carries memoffload to a bare GPU machine
# (its own Python, torch, compiler and ninja; no apt, no PyPI, no network).
#
#   scripts/gpu-kit.sh [DIR]      # default .gpu-kit/ (git-ignored)
#
# The folder holds memoffloadd, memoffloadctl and memoffload-bench built here
# (RUNPATH $ORIGIN/../lib), every shared library they need that a plain glibc
# system lacks (gRPC, protobuf, abseil, prometheus-cpp, ...; RUNPATH $ORIGIN),
# libmemoffload_client.so with the headers of the client, so that
# memoffload._C is built there against that machine's torch (build_c.py),
# the Python package, the tests and the benches, and run.sh, which runs it
# all: `DIR/run.sh OUTDIR` (see scripts/gpu-kit/run.sh). It prints the
# folder's size and fails over 60 MiB (KIT_LIMIT_MIB overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KIT=${1:-$ROOT/.gpu-kit}
LIMIT_MIB=${KIT_LIMIT_MIB:-60}
BUILD_DIR=${KIT_BUILD_DIR:-$ROOT/build-kit}

scripts/setup-deps.sh >&2

# A build of its own: no tests, no torch, and binaries that find their
# libraries beside them wherever the folder lands.
BUILD_DIR=$BUILD_DIR BUILD_TARGETS="memoffloadd memoffloadctl memoffload-bench memoffload_client_shared" \
  scripts/build.sh -DMEMOFFLOAD_BUILD_TESTS=OFF -DMEMOFFLOAD_BUILD_TORCH=OFF \
  '-DCMAKE_BUILD_RPATH=$ORIGIN/../lib;$ORIGIN' >&2

stage=$(mktemp -d "${KIT%/}.partial.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,lib,include,src/torch/src,python,tests,bench}

for exe in memoffloadd memoffloadctl memoffload-bench; do
  install -m 0755 "$BUILD_DIR/bin/$exe" "$stage/bin/"
  strip "$stage/bin/$exe"
done
install -m 0755 "$BUILD_DIR/lib/libmemoffload_client.so" "$stage/lib/"
strip --strip-unneeded "$stage/lib/libmemoffload_client.so"

# The libraries every GPU machine has: glibc's own and the C++ runtime (the
# one there is newer than ours and is the one torch loads). Everything else
# travels.
is_system_lib() {
  case "$1" in
    linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
      librt.so.* | libresolv.so.* | libutil.so.* | libanl.so.* | libstdc++.so.* | libgcc_s.so.*)
      return 0 ;;
  esac
  return 1
}
declare -A carried=()
for elf in "$stage"/bin/* "$stage/lib/libmemoffload_client.so"; do
  while read -r name _ path _; do
    [[ -n ${path:-} && $path == /* ]] || continue
    is_system_lib "$name" && continue
    [[ -n ${carried[$name]:-} ]] && continue
    carried[$name]=$path
    cp -L "$path" "$stage/lib/$name"
    chmod 0644 "$stage/lib/$name"
  done < <(ldd "$elf")
done
for lib in "$stage"/lib/*.so*; do
  patchelf --set-rpath '$ORIGIN' "$lib"
done

# What builds memoffload._C there: our headers, the torch layer's sources.
mkdir -p "$stage/include/memoffload"
for part in client/cpp/include common/include shared_mem/include client/torch/include; do
  cp -r "$part/memoffload/." "$stage/include/memoffload/"
done
cp client/torch/*.cc client/torch/*.h "$stage/src/torch/"
cp client/torch/src/*.cc client/torch/src/*.h "$stage/src/torch/src/"
cp -r client/python/memoffload "$stage/python/"
cp -r tests/python "$stage/tests/"
mkdir -p "$stage/docs"
cp docs/torch_frameworks.md "$stage/docs/"  # the recipes the gpu tests run verbatim
cp bench/gpu_bench.py bench/torch_bench.py bench/async_save_bench.py "$stage/bench/"
cp scripts/gpu-kit/run.sh scripts/gpu-kit/build_c.py scripts/gpu-kit/summarize.py "$stage/"
find "$stage" \( -name __pycache__ -o -name '_C*.so' -o -name '*.pyc' \) -prune -exec rm -rf {} +
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(gcc --version | head -1)"
  echo "carried libraries: ${#carried[@]}"
} >"$stage/VERSION"

rm -rf "$KIT"
mv "$stage" "$KIT"
trap - EXIT
size=$(du -sb "$KIT" | cut -f1)
mib=$(awk -v b="$size" 'BEGIN { printf "%.1f", b / 1048576 }')
tree_mib=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 |
  awk '{ printf "%.1f", $1 / 1048576 }')
echo "gpu-kit: $KIT: $mib MiB ($(find "$KIT" -type f | wc -l) files, ${#carried[@]} carried libraries);" \
  "with the tracked tree ($tree_mib MiB) $(awk -v a="$mib" -v b="$tree_mib" 'BEGIN { print a + b }') MiB travel"
if awk -v m="$mib" -v l="$LIMIT_MIB" 'BEGIN { exit !(m > l) }'; then
  echo "gpu-kit: $mib MiB is over the limit of $LIMIT_MIB MiB" >&2
  exit 1
fi
echo "gpu-kit: on the GPU machine: $KIT/run.sh OUTDIR   (device tool: carry [\"${KIT#$ROOT/}\"])"
