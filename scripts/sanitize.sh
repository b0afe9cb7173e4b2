#!/usr/bin/env bash
# Sanitizer and fuzzing pass (docs/reliability.md, "Sanitizers" and "Fuzzing").
#
#   1. build-san/: clang-14 with ASan+UBSan (MEMOFFLOAD_SANITIZE) and the
#      libFuzzer targets (MEMOFFLOAD_FUZZ); runs `ctest -L 'unit|integration'`
#      with leak detection on. With clang, CMakeLists.txt compiles our own
#      targets with -Wthread-safety -Werror=thread-safety: a member marked
#      ABSL_GUARDED_BY touched without its absl::Mutex fails this build.
#   2. Runs every fuzz target for FUZZ_SECONDS (default 15) on a scratch copy
#      of its checked-in corpus (tests/fuzz/corpus/<target>); any crash, leak,
#      sanitizer report or failed check fails the script. Crash inputs are kept
#      in build-san/fuzz-artifacts/.
#   3. TSAN=1 (default): build-tsan/ with ThreadSanitizer: daemon_tests
#      (allocator and session table, including the threaded waiting-reserve
#      tests), torch_worker_tests (the torch layer's task worker) and
#      client_threads_tests (one Client used from several threads against a
#      TSan-built memoffloadd) and cuda_engine_tests (the CUDA copy engine
#      against the simulated driver; needs .venv for c10). TSAN=0 skips it.
#
# Exits non-zero on any failure; every step runs even after one failed.
# Environment: FUZZ_SECONDS, TSAN, JOBS (default 2), CC/CXX (default clang-14).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

FUZZ_SECONDS=${FUZZ_SECONDS:-15}
TSAN=${TSAN:-1}
JOBS=${JOBS:-2}
export CC=${CC:-clang-14} CXX=${CXX:-clang++-14}
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
# ccache keeps a second run (a fresh clone on the same machine) cheap.
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=$ROOT
  GENERATOR+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

status=0
fail() {
  echo "sanitize: FAILED: $*" >&2
  status=1
}
started=$SECONDS
elapsed() { echo "$((SECONDS - started))s"; }

# -O1 keeps the sanitized tests fast enough; asserts stay on.
common_cmake=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g"
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DMEMOFFLOAD_BUILD_TORCH=OFF
  -DMEMOFFLOAD_BUILD_BENCH=OFF)

# Sanitizer runtime options. Leaks are errors; third-party leaks we cannot
# fix are listed (narrowly) in tests/sanitizers/lsan.supp.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:strict_init_order=1:check_initialization_order=1"
export LSAN_OPTIONS="suppressions=$ROOT/tests/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

echo "== sanitize: configure and build build-san ($CXX, ASan+UBSan, fuzzers)"
if ! cmake -S . -B build-san "${GENERATOR[@]}" "${common_cmake[@]}" \
  -DMEMOFFLOAD_SANITIZE=ON -DMEMOFFLOAD_FUZZ=ON >/dev/null; then
  fail "cmake configure of build-san"
  exit 1
fi
if ! nice cmake --build build-san -j "$JOBS"; then
  fail "build of build-san"
  exit 1
fi
echo "   built in $(elapsed)"

echo "== sanitize: ctest -L 'unit|integration' under ASan+UBSan"
(cd build-san && MEMOFFLOAD_BIN_DIR="$ROOT/build-san/bin" \
  ctest -L 'unit|integration' --output-on-failure --timeout 900) || fail "ctest under ASan+UBSan"
echo "   tests done at $(elapsed)"

echo "== sanitize: fuzz targets, ${FUZZ_SECONDS}s each"
artifacts=$ROOT/build-san/fuzz-artifacts
mkdir -p "$artifacts"
scratch=$(mktemp -d /tmp/memoffload-fuzz.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
shopt -s nullglob
targets=(build-san/bin/fuzz_*)
[[ ${#targets[@]} -gt 0 ]] || fail "no fuzz targets in build-san/bin"
for bin in "${targets[@]}"; do
  name=$(basename "$bin")
  [[ $name == fuzz_regressions ]] && continue
  corpus=$scratch/$name
  mkdir -p "$corpus"
  if [[ -d tests/fuzz/corpus/$name ]]; then cp tests/fuzz/corpus/"$name"/* "$corpus"/; fi
  log=$artifacts/$name.log
  if "$bin" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/$name-" "$corpus" >"$log" 2>&1; then
    echo "   $name: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" |
      grep -o '[0-9]*$') runs, no crash"
  else
    tail -n 40 "$log" >&2
    fail "$name (log $log, inputs $artifacts/$name-*)"
  fi
done
echo "   fuzzing done at $(elapsed)"

if [[ $TSAN == 1 ]]; then
  echo "== sanitize: ThreadSanitizer (build-tsan): daemon_tests, torch_worker_tests, client_threads_tests, cuda_engine_tests"
  tsan_started=$SECONDS
  # client_threads_tests runs one Client from several threads against a
  # TSan-built memoffloadd; DaemonProcess fails the test on any sanitizer
  # report in the daemon's log. Debian's gRPC/abseil are not instrumented:
  # ignore_noninstrumented_modules=1 keeps TSan from checking accesses made
  # inside them (without it, abseil's GraphCycles and gRPC's epoll poller
  # give false reports); tests/sanitizers/tsan.supp is empty today.
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$ROOT/tests/sanitizers/tsan.supp"
  # The CUDA copy engine against the simulated driver needs c10 (the device
  # type) from the project's torch: with .venv (scripts/venv.sh; test.sh makes
  # it first) the build-tsan tree configures the torch layer and builds only
  # the engine's tests.
  tsan_torch=(-DMEMOFFLOAD_BUILD_TORCH=OFF)
  tsan_targets=(daemon_tests torch_worker_tests client_threads_tests memoffloadd)
  if [[ -x $ROOT/.venv/bin/python ]]; then
    tsan_torch=(-DMEMOFFLOAD_BUILD_TORCH=ON -DMEMOFFLOAD_PYTHON="$ROOT/.venv/bin/python")
    tsan_targets+=(cuda_engine_tests cuda_engine_probe)
  else
    fail "no .venv: cuda_engine_tests cannot run under ThreadSanitizer (run scripts/venv.sh)"
  fi
  if cmake -S . -B build-tsan "${GENERATOR[@]}" "${common_cmake[@]}" "${tsan_torch[@]}" \
    -DCMAKE_C_FLAGS="-fsanitize=thread" -DCMAKE_CXX_FLAGS="-fsanitize=thread" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
    >/dev/null &&
    nice cmake --build build-tsan -j "$JOBS" --target "${tsan_targets[@]}"; then
    echo "   built in $((SECONDS - tsan_started))s"
    if [[ -x build-tsan/bin/cuda_engine_tests ]]; then
      build-tsan/bin/cuda_engine_tests --gtest_brief=1 ||
        fail "cuda_engine_tests under ThreadSanitizer"
    fi
    build-tsan/bin/daemon_tests --gtest_brief=1 || fail "daemon_tests under ThreadSanitizer"
    build-tsan/bin/torch_worker_tests --gtest_brief=1 ||
      fail "torch_worker_tests under ThreadSanitizer"
    MEMOFFLOAD_BIN_DIR="$ROOT/build-tsan/bin" build-tsan/bin/client_threads_tests --gtest_brief=1 ||
      fail "client_threads_tests under ThreadSanitizer"
  else
    fail "build of build-tsan"
  fi
  echo "   tsan done at $(elapsed) ($((SECONDS - tsan_started))s)"
fi

if ((status == 0)); then
  echo "sanitize: all passed in $(elapsed)"
else
  echo "sanitize: failures (see above) after $(elapsed)" >&2
fi
exit $status
