#!/usr/bin/env bash
# memoffload's GPU checks on a bare GPU machine, from the kit this file sits
# in (made by scripts/gpu-kit.sh). One command:
#
#   KIT/run.sh OUTDIR [--only build|tests|bench]
#
# Steps, each with a time limit, its output in OUTDIR's logs:
#   check   GPU (nvidia-smi), driver, Python, torch, compiler, ninja, and
#           that every binary of the kit finds its libraries
#   build   memoffload._C against this machine's torch (build_c.py; every core)
#   daemon  memoffloadd from the kit, answering memoffloadctl status
#   tests   the gpu-marked tests (pytest -m gpu); no CUDA device: skipped
#   bench   bench/gpu_bench.py (--cpu-smoke without a device) and the attach
#           bench with 4 KiB pages and with hugepages
# --only runs check and that one step (build first: later steps use its _C).
# OUTDIR gets results.jsonl (one JSON line per step and per figure),
# summary.txt (one line) and logs.tar.gz. Every process started is stopped.
# Exit 0 when every step run passed; else non-zero with the failing step
# named. The gpu tests count as skipped (not failed) only where no GPU is
# present: a GPU that nvidia-smi sees but torch cannot use fails the check.
#
# Environment: MEMOFFLOAD_KIT_PYTHON (default python3), MEMOFFLOAD_KIT_WORK
# (where _C is built; default KIT/work), MEMOFFLOAD_KIT_ARENA (the bench
# daemon's arena; default 24GiB with a GPU, 256MiB without).
set -uo pipefail
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
usage() { echo "usage: $0 OUTDIR [--only build|tests|bench]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
OUT=$1
shift
only=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) [[ $# -ge 2 ]] || usage; only=$2; shift 2 ;;
    --only=*) only=${1#--only=}; shift ;;
    *) usage ;;
  esac
done
case "$only" in "" | build | tests | bench) ;; *) usage ;; esac
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
PY=${MEMOFFLOAD_KIT_PYTHON:-python3}
WORK=${MEMOFFLOAD_KIT_WORK:-$KIT/work}
LOGS=$OUT/logs
RESULTS=$OUT/results.jsonl
mkdir -p "$LOGS" "$WORK"
: >"$RESULTS"
export MEMOFFLOAD_BIN_DIR=$KIT/bin
export PYTHONPATH=$WORK/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
started=$(date +%s)
failed=()
scratch=$(mktemp -d /tmp/memoffload-kit.XXXXXX)

say() { echo "run.sh: $*" | tee -a "$LOGS/run.log" >&2; }

# The processes of this kit: this uid's (of /proc/PID, which the process's
# effective uid owns) whose executable is a file in $KIT/bin (compared as a
# string, not a pattern). Never another user's, whatever its command line.
kit_pids() {
  local proc exe
  for proc in /proc/[0-9]*; do
    [[ -O $proc ]] || continue
    exe=$(readlink "$proc/exe" 2>/dev/null) || continue
    [[ ${exe% (deleted)} == "$KIT/bin/"* ]] && echo "${proc#/proc/}"
  done
}

# The bench raises vm.nr_hugepages and writes the value before it to this
# file first; whoever finds the file puts that value back: the bench when it
# is done, finish() on every exit of this script (a step that timed out
# included), and the next run at its start (this one was killed itself).
HUGEPAGES_SAVED=$WORK/nr_hugepages.before
restore_hugepages() {
  [[ -f $HUGEPAGES_SAVED ]] || return 0
  local before
  before=$(cat "$HUGEPAGES_SAVED")
  if [[ $(cat /proc/sys/vm/nr_hugepages 2>/dev/null) != "$before" ]]; then
    if echo "$before" 2>/dev/null >/proc/sys/vm/nr_hugepages; then
      say "vm.nr_hugepages restored to $before"
    else
      say "could not restore vm.nr_hugepages to $before"
    fi
  fi
  rm -f "$HUGEPAGES_SAVED"
}

# Every process of this kit still running (the bench's daemon, and any a
# test left behind) is stopped at exit, vm.nr_hugepages is put back, then
# the logs are packed.
finish() {
  [[ -f $scratch/daemon.pid ]] && kill "$(cat "$scratch/daemon.pid")" 2>/dev/null
  for pid in $(kit_pids); do
    kill "$pid" 2>/dev/null
  done
  sleep 1
  for pid in $(kit_pids); do
    say "killing leftover $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
    kill -9 "$pid" 2>/dev/null
  done
  restore_hugepages
  cp -f "$scratch"/*.log "$LOGS/" 2>/dev/null
  rm -rf "$scratch"
  "$PY" "$KIT/summarize.py" "$RESULTS" "$(($(date +%s) - started))" "${failed[*]:-}" \
    >"$OUT/summary.txt" 2>>"$LOGS/run.log" || echo "summary failed (see logs)" >"$OUT/summary.txt"
  tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$LOGS"
  cat "$OUT/summary.txt"
}
trap finish EXIT
restore_hugepages  # left behind by a run that was killed

record() {  # record STEP STATUS SECONDS [DETAIL]
  "$PY" -c 'import json, sys
row = {"step": sys.argv[1], "status": sys.argv[2], "seconds": int(sys.argv[3])}
if len(sys.argv) > 4 and sys.argv[4]:
    row["detail"] = sys.argv[4]
print(json.dumps(row))' "$@" >>"$RESULTS" 2>/dev/null ||
    echo "{\"step\": \"$1\", \"status\": \"$2\", \"seconds\": $3}" >>"$RESULTS"
}

# run_step NAME LIMIT_S COMMAND...: output to logs/NAME.log; exit 77 = skipped.
run_step() {
  local name=$1 limit=$2
  shift 2
  say "step $name (limit ${limit}s)"
  local t0=$SECONDS rc=0
  # A step is a function of this file run in a bash of its own, or a command.
  if declare -F "$1" >/dev/null; then
    timeout --kill-after=10 "$limit" bash -c "$*" >>"$LOGS/$name.log" 2>&1 || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" >>"$LOGS/$name.log" 2>&1 || rc=$?
  fi
  local took=$((SECONDS - t0))
  if ((rc == 0)); then
    record "$name" ok "$took"
  elif ((rc == 77)); then
    record "$name" skipped "$took" "$(tail -n 3 "$LOGS/$name.log" | tr '\n' ' ')"
    say "step $name skipped: $(tail -n 1 "$LOGS/$name.log")"
  else
    local why="exit $rc"
    ((rc == 124 || rc == 137)) && why="timed out after ${limit}s"
    record "$name" failed "$took" "$why: $(tail -n 3 "$LOGS/$name.log" | tr '\n' ' ')"
    failed+=("$name")
    say "step $name FAILED ($why); last lines of logs/$name.log:"
    tail -n 15 "$LOGS/$name.log" >&2
  fi
  return $rc
}

check() {
  echo "kit: $KIT"
  cat "$KIT/VERSION"
  echo "machine: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader ||
      echo "nvidia-smi: failed"
  else
    echo "nvidia-smi: not found"
  fi
  command -v "$PY" >/dev/null || { echo "python: $PY not found (set MEMOFFLOAD_KIT_PYTHON)"; return 1; }
  "$PY" - <<'EOF' || return 1
import json, os, shutil, subprocess, sys, sysconfig
info = {"step": "machine", "python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
except Exception as e:
    print(f"torch: cannot import: {e}")
    sys.exit(1)
info["torch"] = torch.__version__
info["torch_cuda"] = torch.version.cuda
info["cxx11_abi"] = torch.compiled_with_cxx11_abi()
info["cuda_available"] = torch.cuda.is_available()
if info["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    info["device"] = p.name
    info["device_memory_gib"] = round(p.total_memory / 2**30, 1)
    info["devices"] = torch.cuda.device_count()
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
except (OSError, IndexError, subprocess.TimeoutExpired):
    info["driver"] = None
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
info["python_h"] = os.path.exists(header)
cxx = os.environ.get("CXX", "c++")
info["cxx"] = shutil.which(cxx)
if info["cxx"]:
    info["cxx_version"] = subprocess.run([cxx, "--version"], capture_output=True,
                                         text=True).stdout.splitlines()[0]
info["ninja"] = shutil.which("ninja")
with open(os.environ["RESULTS"], "a") as f:
    f.write(json.dumps(info) + "\n")
print(json.dumps(info, indent=1))
missing = [what for what, ok in (("Python.h (the Python headers)", info["python_h"]),
                                 ("a C++ compiler (c++ or $CXX)", info["cxx"]),
                                 ("ninja", info["ninja"]),
                                 ("torch with the C++11 ABI", info["cxx11_abi"])) if not ok]
if missing:
    print("missing: " + ", ".join(missing) + ": memoffload._C cannot be built here")
    sys.exit(1)
if info["driver"] and not info["cuda_available"]:
    # Else the gpu tests would be "skipped" and the bench a CPU smoke run on
    # a GPU machine, and the run would pass having measured nothing.
    print(f"nvidia-smi sees a GPU (driver {info['driver']}) but torch {info['torch']} cannot use "
          "it (torch.cuda.is_available() is False): nothing could be measured")
    sys.exit(1)
EOF
  # Every binary and library of the kit must find what it needs (in the kit,
  # or in the few system libraries it leaves out).
  local bad=0
  for elf in "$KIT"/bin/* "$KIT"/lib/*.so*; do
    if ldd "$elf" 2>&1 | grep -q "not found"; then
      echo "$elf: $(ldd "$elf" | grep "not found" | awk '{print $1}' | tr '\n' ' ')not found"
      bad=1
    fi
  done
  ((bad == 0)) || return 1
  "$KIT/bin/memoffloadd" --version || return 1
}

start_daemon() {
  local arena=${MEMOFFLOAD_KIT_ARENA:-}
  if [[ -z $arena ]]; then
    if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      arena=24GiB
    else
      arena=256MiB
    fi
  fi
  local chunk=1GiB
  [[ $arena == *MiB ]] && chunk=64MiB
  mkdir -m 0700 "$scratch/rt"
  "$KIT/bin/memoffloadd" --runtime-dir="$scratch/rt" --arena-size="$arena" --chunk-size="$chunk" \
    --metrics-address=none >"$scratch/memoffloadd-bench.log" 2>&1 &
  echo $! >"$scratch/daemon.pid"
  local daemon_pid=$!
  for _ in $(seq 1 600); do
    if "$KIT/bin/memoffloadctl" --runtime-dir "$scratch/rt" status >/dev/null 2>&1; then
      "$KIT/bin/memoffloadctl" --runtime-dir "$scratch/rt" status
      echo "{\"step\": \"daemon_status\", \"status\": $("$KIT/bin/memoffloadctl" --runtime-dir "$scratch/rt" --json status)}" >>"$RESULTS"
      return 0
    fi
    kill -0 "$daemon_pid" 2>/dev/null || { cat "$scratch/memoffloadd-bench.log"; return 1; }
    sleep 0.1
  done
  echo "memoffloadd did not answer within 60 s"
  return 1
}

tests() {
  cd "$KIT/tests/python" || return 1
  "$PY" -m pytest -m gpu -rs -v -p no:cacheprovider --junitxml="$LOGS/gpu-tests.xml" .
}

bench() {
  local rc=0 mode=()
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || mode=(--cpu-smoke)
  "$PY" "$KIT/bench/gpu_bench.py" --runtime-dir "$scratch/rt" "${mode[@]}" | tee -a "$RESULTS" || rc=1
  # dcp.async_save of a CUDA state: staged into the checkpoint's region vs
  # DefaultStager's pinned shared buffer.
  if ((${#mode[@]} == 0)); then
    "$PY" "$KIT/bench/async_save_bench.py" --device cuda --size 1GiB --rounds 3 |
      tee -a "$RESULTS" || rc=1
  fi
  # The arena on 4 KiB pages, then on hugepages (reserved here when we may).
  local arena=4GiB
  ((${#mode[@]})) && arena=256MiB
  # Building the arena (next to a parallel memset) and the first write into
  # an attached one (next to memcpy), on 4 KiB pages and on hugepages.
  "$KIT/bin/memoffload-bench" startup --json --arena-size "$arena" | tee -a "$RESULTS" || rc=1
  "$KIT/bin/memoffload-bench" attach --json --arena-size "$arena" --attach-samples 50 |
    tee -a "$RESULTS" || rc=1
  local pages=$(($(numfmt --from=iec-i "${arena%B}") / 2097152 + 64))
  local before
  before=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)
  if ((${#mode[@]} == 0)) && ((before < pages)); then
    echo "$before" >"$HUGEPAGES_SAVED"
    echo "$pages" 2>/dev/null >/proc/sys/vm/nr_hugepages ||
      echo "could not reserve $pages hugepages (the runs below fall back to 4 KiB pages)"
  fi
  grep -i '^HugePages_\(Total\|Free\)' /proc/meminfo
  "$KIT/bin/memoffload-bench" startup --json --hugepages --arena-size "$arena" |
    tee -a "$RESULTS" || rc=1
  "$KIT/bin/memoffload-bench" attach --json --hugepages --arena-size "$arena" --attach-samples 50 |
    tee -a "$RESULTS" || rc=1
  restore_hugepages
  return $rc
}

export KIT PY WORK LOGS RESULTS OUT scratch HUGEPAGES_SAVED
export -f check start_daemon tests bench say restore_hugepages
cd "$KIT" || exit 2
run_step check 120 check
if ((${#failed[@]} == 0)); then
  if [[ -z $only || $only == build ]]; then
    run_step build 600 "$PY" "$KIT/build_c.py" --kit "$KIT" --work "$WORK"
    grep -h '^{"step": "build_info"' "$LOGS/build.log" >>"$RESULTS" 2>/dev/null
  elif [[ ! -f $WORK/python/memoffload/_C.so ]]; then
    say "no memoffload._C in $WORK: run '$0 $OUT --only build' first"
    failed+=(build)
  fi
fi
if ((${#failed[@]} == 0)) && [[ -z $only || $only == tests || $only == bench ]]; then
  run_step daemon 120 start_daemon
fi
if ((${#failed[@]} == 0)); then
  [[ -z $only || $only == tests ]] && run_step tests 900 tests
  [[ -z $only || $only == bench ]] && run_step bench 900 bench
fi
if ((${#failed[@]})); then
  say "failed: ${failed[*]}"
  exit 1
fi
exit 0
