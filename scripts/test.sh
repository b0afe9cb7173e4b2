#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test suite. Exits non-zero
# on any failure. Set SKIP_PYTHON_TESTS=1 to run only the C++ suites.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh
scripts/build.sh
export MEMOFFLOAD_BIN_DIR="$PWD/build/bin"

status=0
echo "== ctest"
(cd build && ctest --output-on-failure --timeout 900) || status=1

if [[ -z "${SKIP_PYTHON_TESTS:-}" ]] && compgen -G "tests/python/test_*.py" >/dev/null; then
  echo "== pytest (tests/python, Debian's /usr/bin/python3)"
  PYTHONPATH="$PWD/client/python" /usr/bin/python3 -m pytest -q -p no:cacheprovider \
    tests/python || status=1
fi
exit $status
