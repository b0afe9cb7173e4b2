#!/usr/bin/env bash
# Creates (once) the project's Python environment and installs the client
# package into it the way a user would (pip, built against that torch).
#
#   scripts/venv.sh            # .venv/ with the pinned test requirements,
#                              # then `pip install ./client/python` into it
#   scripts/venv.sh --deps     # only the environment, not the client package
#
# MEMOFFLOAD_VENV moves it (default: <repo>/.venv); MEMOFFLOAD_BASE_PYTHON is
# the interpreter it is made from (default: python3 on PATH). Prints the
# environment's python as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${MEMOFFLOAD_VENV:-$ROOT/.venv}
BASE_PYTHON=${MEMOFFLOAD_BASE_PYTHON:-python3}
REQS=$ROOT/scripts/requirements-test.txt
PY=$VENV/bin/python

if [[ ! -x $PY ]]; then
  echo "venv.sh: creating $VENV from $($BASE_PYTHON --version 2>&1)" >&2
  "$BASE_PYTHON" -m venv "$VENV"
fi
# Reinstall the pinned requirements only when the file changed.
stamp=$VENV/.requirements.sha256
want=$(sha256sum "$REQS" | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "venv.sh: installing $(grep -c '==' "$REQS") pinned packages (torch CPU build first)" >&2
  # torch alone first, by its exact pin: anything looser may fetch a CUDA build.
  "$PY" -m pip install -q --disable-pip-version-check "$(grep '^torch==' "$REQS")" >&2
  "$PY" -m pip install -q --disable-pip-version-check -r "$REQS" >&2
  # The rest (transformers, lightning, ...) must not have replaced it.
  pinned=$(grep '^torch==' "$REQS" | cut -d= -f3)
  have=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
  if [[ $have != "$pinned" ]]; then
    echo "venv.sh: the requirements replaced torch $pinned by $have" >&2
    exit 1
  fi
  echo "$want" >"$stamp"
fi

if [[ "${1:-}" != "--deps" ]]; then
  # The user's command (docs/torch.md), without isolation so the build sees
  # this environment's torch; the CMake build tree is kept in build/python
  # so that a second run rebuilds incrementally.
  echo "venv.sh: pip install ./client/python" >&2
  settings=()
  if command -v ccache >/dev/null; then
    export CCACHE_BASEDIR=$ROOT
    settings=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    --force-reinstall "${settings[@]}" ./client/python >&2
fi
echo "$PY"
