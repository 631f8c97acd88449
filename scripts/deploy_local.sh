#!/usr/bin/env bash
# Deployment mode on one machine: a real SuperLink and one SuperNode per client, each its
# own process on loopback sockets, then `flwr run` against that SuperLink. On real devices,
# run the same `flower-supernode` line on each device with the SuperLink's address (and
# TLS: --root-certificates instead of --insecure).
#
#   scripts/deploy_local.sh [EXPERIMENT] [HYDRA OVERRIDES...]     (default: tiny)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(cd "${BIN:-.venv/bin}" && pwd)  # the environment with edgefuse and flwr installed
EXPERIMENT=${1:-tiny}; shift || true
OVERRIDES="$*"
WORK=$(mktemp -d /tmp/edgefuse-deploy.XXXXXX)
export FLWR_HOME="$WORK/flwr" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 PATH="$BIN:$PATH"
mkdir -p "$FLWR_HOME"
N=$("$BIN/python" -c "from edgefuse.config import compose; import sys; \
print(len(compose(sys.argv[1], sys.argv[2]).federation.clients))" "$EXPERIMENT" "$OVERRIDES")
PORT=${PORT:-19091}  # the SuperLink serves all its APIs over HTTP on this port (flwr 1.42)
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "deploy"
[superlink.deploy]
address = "127.0.0.1:$PORT"
insecure = true
EOF

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

flower-superlink --insecure --host 127.0.0.1 --port "$PORT" \
  --database "$WORK/state.db" > "$WORK/superlink.log" 2>&1 &
pids+=($!)
ready=0
for _ in $(seq 60); do  # wait until the SuperLink answers its health check
  if "$BIN/python" -c "import httpx, sys; sys.exit(not httpx.get('http://127.0.0.1:$PORT/health', timeout=1).is_success)" 2>/dev/null; then
    ready=1; break
  fi
  sleep 1
done
[ "$ready" = 1 ] || { echo "[deploy] the SuperLink did not come up; see $WORK/superlink.log" >&2; exit 1; }
for ((i = 0; i < N; i++)); do
  flower-supernode --insecure --superlink "127.0.0.1:$PORT" --port $((PORT + 10 + i)) \
    --node-config "partition-id=$i num-partitions=$N" > "$WORK/supernode-$i.log" 2>&1 &
  pids+=($!)
done
echo "[deploy] SuperLink + $N SuperNodes up; logs in $WORK"
OUT="${EDGEFUSE_OUTPUTS:-$PWD/outputs}/deploy-$(date +%Y%m%d-%H%M%S)-$EXPERIMENT"
CACHE=$("$BIN/python" -c "from edgefuse.models import cache_dir; print(cache_dir())")
PIN="paths.cache_dir='$CACHE'"
MIRROR=${EDGEFUSE_DATA_MIRROR:-}
[ -z "$MIRROR" ] && [ -d ../shared/data/dolly ] && MIRROR=../shared/data
if [ -n "$MIRROR" ]; then PIN="$PIN data.mirror='$(realpath "$MIRROR")'"; else PIN="$PIN data.mirror=null"; fi
cat > "$WORK/run_config.toml" <<EOF
experiment = "$EXPERIMENT"
overrides = "$OVERRIDES $PIN"
output-dir = "$OUT"
EOF
flwr run . deploy --stream --run-config "$WORK/run_config.toml"
"$BIN/python" -c "import sys; from edgefuse.results import load_results; \
r = load_results(sys.argv[1]); print('[deploy] status:', r['status']); sys.exit(r['status'] != 'completed')" "$OUT"
