#!/usr/bin/env bash
# Two "nodes" on one machine, as docs/checkpoints.md sets up real ones: a
# memoffloadd per node with the same replication key file, 4 ranks (torchrun
# per node, 2 ranks each) replicating from 127.0.0.2 (node 0) and 127.0.0.3
# (node 1). It saves a checkpoint with a replica on the other node, loses
# node 1 (its daemon killed, a fresh empty one started), and restores bit
# for bit: node 1's shards come back from node 0's copies.
#
#   examples/two_nodes.sh            # after scripts/build.sh and scripts/venv.sh
#
# Uses $MEMOFFLOAD_BIN_DIR (default build/bin) and $MEMOFFLOAD_PYTHON
# (default .venv/bin/python, with torch and the memoffload package).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${MEMOFFLOAD_BIN_DIR:-$repo/build/bin}
python=${MEMOFFLOAD_PYTHON:-$repo/.venv/bin/python}
for need in "$bin/memoffloadd" "$python"; do
  [[ -x $need ]] || { echo "two_nodes.sh: $need not found (scripts/build.sh, scripts/venv.sh)" >&2; exit 1; }
done

work=$(mktemp -d /tmp/memoffload-two-nodes-XXXXXX)
daemons=()
cleanup() {
  for pid in "${daemons[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# One cluster secret, the same file on every node, readable by the daemon alone.
echo "k1 $(openssl rand -hex 32)" >"$work/replication-key"
chmod 0400 "$work/replication-key"

start_daemon() {  # node
  mkdir -p -m 0700 "$work/node$1"
  "$bin/memoffloadd" --runtime-dir="$work/node$1" --arena-size=256MiB --chunk-size=16MiB \
    --metrics-address=none --replication-key-file="$work/replication-key" \
    >>"$work/memoffloadd-node$1.log" 2>&1 &
  daemons[$1]=$!
  for _ in $(seq 100); do
    [[ -S $work/node$1/memoffload.sock ]] && return 0
    sleep 0.1
  done
  echo "two_nodes.sh: node $1's memoffloadd did not start:" >&2
  cat "$work/memoffloadd-node$1.log" >&2
  exit 1
}

# The job's store port: a free one below the ephemeral range, where no
# listener of the link (an ephemeral port) can take it meanwhile.
port=$("$python" -c '
import random, socket
while True:
    p = random.randrange(20000, 32000)
    try:
        socket.socket().bind(("", p))
        print(p)
        break
    except OSError:
        pass')
run_job() {  # phase: torchrun on each node, 2 ranks each
  local pids=() node
  for node in 0 1; do
    (cd "$work" && MEMOFFLOAD_RUNTIME_DIR=$work/node$node \
      MEMOFFLOAD_REPLICATION_ADDRESS=127.0.0.$((2 + node)) GLOO_SOCKET_IFNAME=lo \
      "$python" -m torch.distributed.run --nnodes=2 --nproc-per-node=2 --node-rank=$node \
      --master-addr=127.0.0.1 --master-port="$port" \
      "$repo/examples/two_nodes_train.py" "$1" "$work") &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

start_daemon 0
start_daemon 1
echo "== train: 4 ranks on 2 nodes, step-4 saved with a replica on the other node"
run_job train
echo "== node 1 lost: its daemon killed, a fresh empty one started"
kill -9 "${daemons[1]}"
wait "${daemons[1]}" 2>/dev/null || true
start_daemon 1
echo "== restore: every rank loads step-4; node 1's shards come from node 0"
run_job restore | sort
echo "two_nodes.sh: restored bit for bit after losing a node"
