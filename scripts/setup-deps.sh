#!/usr/bin/env bash
# Installs the Debian 12 packages memoffload needs to build, run and test.
# One source of truth for dependencies: the Dockerfile and CI read DEPS_* from here.
# Idempotent: a second run installs nothing and prints nothing but a short line.
set -euo pipefail

# Build and runtime libraries of the daemon, client and tools.
DEPS_BUILD=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  prometheus-cpp-dev libboost-dev libsystemd-dev libtomlplusplus-dev
)
# Headers for the Python extension. Torch itself, pytest and transformers come
# from PyPI into the project's virtual environment (scripts/venv.sh).
DEPS_TORCH=(python3-dev pybind11-dev)
# Tests and benchmarks; patchelf for the GPU kit (scripts/gpu-kit.sh).
DEPS_TEST=(ccache ninja-build googletest libgtest-dev libgmock-dev libbenchmark-dev prometheus curl
  yamllint systemd strace python3-yaml
  clang-14 libclang-rt-14-dev
  patchelf)
# The container tests (CTest label container, tests/deploy/test_container.py
# and test_systemd_boot.py): podman with runc (crun fails on hybrid cgroups),
# and debootstrap for the base image, since no registry is reachable.
# Installed with --with-container, which scripts/test.sh passes.
DEPS_CONTAINER=(podman buildah runc debootstrap)

want=("${DEPS_BUILD[@]}" "${DEPS_TORCH[@]}" "${DEPS_TEST[@]}")
print=0
for arg in "$@"; do
  case "$arg" in
    --print) print=1 ;;
    --with-container) want+=("${DEPS_CONTAINER[@]}") ;;
    *) echo "usage: scripts/setup-deps.sh [--with-container] [--print]" >&2; exit 2 ;;
  esac
done
if ((print)); then
  printf '%s\n' "${want[@]}"
  exit 0
fi

missing=()
for pkg in "${want[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup-deps: all ${#want[@]} packages present"
  exit 0
fi

echo "setup-deps: installing ${#missing[@]} missing packages: ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup-deps: done"
