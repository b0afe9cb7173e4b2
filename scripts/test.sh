#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test suite. Exits non-zero
# on any failure. Extra arguments go to ctest (e.g. -L unit, -R integration).
# The Python suites run in the project's virtual environment (.venv, made by
# scripts/venv.sh: torch 2.13.0 CPU, pytest, transformers, and this client
# installed with pip, as a user installs it).
# First scripts/sanitize.sh (ASan+UBSan, fuzzers, TSan; SANITIZE=0 skips it),
# then every suite of the normal build through CTest, whose summary closes
# the output.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh --with-container
python=$(scripts/venv.sh | tail -n 1)
scripts/build.sh -DMEMOFFLOAD_BUILD_TORCH=ON -DMEMOFFLOAD_PYTHON="$python"
export MEMOFFLOAD_BIN_DIR="$PWD/build/bin"

# CI keeps the head and the tail of this output: at the end, repeat what
# failed (gtest failures with their next lines, sanitizer summaries, pytest
# failures) from each build's last ctest log.
failure_digest() {
  local log
  for log in "$ROOT"/build-san/Testing/Temporary/LastTest.log \
    "$ROOT"/build-tsan/Testing/Temporary/LastTest.log "$ROOT"/build/Testing/Temporary/LastTest.log; do
    [[ -f $log ]] || continue
    if grep -q -E '^\[  FAILED  \]|: Failure$|^SUMMARY: [A-Za-z]+Sanitizer|^FAILED |^E   ' "$log"; then
      echo "== test.sh: what failed in ${log#"$ROOT"/}:"
      grep -A8 -E ': Failure$|^SUMMARY: [A-Za-z]+Sanitizer' "$log" | head -n 120
      grep -E '^\[  FAILED  \]|^FAILED |^E   ' "$log" | head -n 40
    fi
  done
}
ROOT=$PWD

sanitize_status=0
if [[ "${SANITIZE:-1}" != 0 && $# -eq 0 ]]; then
  scripts/sanitize.sh || sanitize_status=1
fi

# Every suite (C++ unit and integration, Python torch tests, deploy checks,
# metrics end-to-end) is registered with CTest, so its summary is the one to read.
cd build
ctest_status=0
ctest --output-on-failure --timeout 900 "$@" || ctest_status=1
if ((sanitize_status != 0 || ctest_status != 0)); then
  failure_digest
fi
if ((sanitize_status != 0)); then
  echo "test.sh: scripts/sanitize.sh failed (see its output above)" >&2
fi
exit $((ctest_status | sanitize_status))
