#!/usr/bin/env bash
# Deployment mode on one machine: a real SuperLink and one SuperNode per client, each its
# own process on loopback sockets, then `flwr run` against that SuperLink. On real devices,
# run the same `flower-supernode` line on each device with the SuperLink's address (and
# TLS: --root-certificates instead of --insecure).
#
#   scripts/deploy_local.sh [EXPERIMENT] [HYDRA OVERRIDES...]     (default: tiny)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
EXPERIMENT=${1:-tiny}; shift || true
OVERRIDES="$*"
WORK=$(mktemp -d /tmp/edgefuse-deploy.XXXXXX)
export FLWR_HOME="$WORK/flwr" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 PATH="$PWD/$BIN:$PATH"
mkdir -p "$FLWR_HOME"
N=$("$BIN/python" -c "from edgefuse.config import compose; import sys; \
print(len(compose(sys.argv[1], sys.argv[2]).federation.clients))" "$EXPERIMENT" "$OVERRIDES")
PORT=${PORT:-19091}  # SuperLink: PORT (runtime API), PORT+1 (Fleet API), PORT+2 (Control API)
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "deploy"
[superlink.deploy]
address = "127.0.0.1:$((PORT + 2))"
insecure = true
EOF

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

flower-superlink --insecure --host 127.0.0.1 --port "$PORT" \
  --fleet-api-address "127.0.0.1:$((PORT + 1))" --control-api-address "127.0.0.1:$((PORT + 2))" \
  --database "$WORK/state.db" > "$WORK/superlink.log" 2>&1 &
pids+=($!)
for ((i = 0; i < N; i++)); do
  flower-supernode --insecure --superlink "127.0.0.1:$((PORT + 1))" --port $((PORT + 10 + i)) \
    --node-config "partition-id=$i num-partitions=$N" > "$WORK/supernode-$i.log" 2>&1 &
  pids+=($!)
done
echo "[deploy] SuperLink + $N SuperNodes up; logs in $WORK"
OUT="${EDGEFUSE_OUTPUTS:-$PWD/outputs}/deploy-$(date +%Y%m%d-%H%M%S)-$EXPERIMENT"
CACHE=$("$BIN/python" -c "from edgefuse.models import cache_dir; print(cache_dir())")
PIN="paths.cache_dir='$CACHE'"
[ -n "${EDGEFUSE_DATA_MIRROR:-}" ] && PIN="$PIN data.mirror='$(realpath "$EDGEFUSE_DATA_MIRROR")'"
cat > "$WORK/run_config.toml" <<EOF
experiment = "$EXPERIMENT"
overrides = "$OVERRIDES $PIN"
output-dir = "$OUT"
EOF
flwr run . deploy --stream --run-config "$WORK/run_config.toml"
"$BIN/python" -c "import sys; from edgefuse.results import load_results; \
r = load_results(sys.argv[1]); print('[deploy] status:', r['status']); sys.exit(r['status'] != 'completed')" "$OUT"
