#!/usr/bin/env bash
# e2e: runs scripts/demo.sh (what `scripts/run.sh --demo` runs after its
# build step) against this build and checks its closing summary: every step's
# loss and gradients bit-identical to training without offload, and bytes
# that really went through the arena and came back.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
out=$(scripts/demo.sh "$@" 2>&1)
rc=$?
printf '%s\n' "$out"
echo "demo_test: demo.sh exited with $rc after $(($(date +%s) - start)) s"
fail() {
  echo "demo_test: FAIL: $*" >&2
  exit 1
}
[[ $rc -eq 0 ]] || fail "demo.sh exited with $rc, expected 0"
grep -qE '^losses and gradients of all [0-9]+ steps are bit-identical to training without offload$' \
  <<<"$out" || fail "no 'bit-identical' closing line"
summary=$(grep -E '^total offloaded ' <<<"$out") || fail "no 'total offloaded' summary line"
read -r offloaded prefetched < <(sed -E 's/^total offloaded +([0-9.]+) MiB, prefetched +([0-9.]+) MiB.*/\1 \2/' <<<"$summary")
awk -v o="$offloaded" -v p="$prefetched" 'BEGIN { exit !(o > 0 && p == o) }' ||
  fail "expected offloaded > 0 MiB and prefetched == offloaded, got '$summary'"
grep -qE 'arena in use after training +0\.00 MiB' <<<"$summary" ||
  fail "arena not empty after training: '$summary'"
echo "demo_test: OK ($offloaded MiB offloaded and prefetched, gradients bit-identical)"
