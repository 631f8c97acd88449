#!/usr/bin/env bash
# Deployment mode on one machine, secure by default: a SuperLink with TLS and SuperNode
# authentication, one registered SuperNode per client (each its own process, TLS to the
# SuperLink, its own authentication key and device home), then `flwr run` of the main job
# over TLS, and a check that the run completed. Logs and keys stay in $WORK.
#
#   scripts/deploy_local.sh [--insecure] [--serve] [EXPERIMENT] [HYDRA OVERRIDES...]  (default: tiny)
#
#   --insecure  plain HTTP and no SuperNode authentication (the old loopback demo)
#   --serve     start and register everything, print "[deploy] ready", then wait (no job;
#               stop with Ctrl-C / SIGTERM): for running `flwr run . deploy` by hand
# Environment: PORT (SuperLink, default 19091; SuperNodes' runtime APIs use PORT+10+i),
# WORK (default: a fresh /tmp/edgefuse-deploy.XXXXXX), BIN (the venv's bin), EDGEFUSE_OUTPUTS.
# The same steps across machines: docs/deployment.md.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(cd "${BIN:-.venv/bin}" && pwd)  # the environment with edgefuse and flwr installed
SECURE=1; SERVE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --insecure) SECURE=0; shift ;;
    --serve) SERVE=1; shift ;;
    --) shift; break ;;
    -*) echo "[deploy] unknown flag $1 (use --insecure, --serve)" >&2; exit 2 ;;
    *) break ;;
  esac
done
EXPERIMENT=${1:-tiny}; shift || true
OVERRIDES="$*"
WORK=${WORK:-$(mktemp -d /tmp/edgefuse-deploy.XXXXXX)}
mkdir -p "$WORK"; chmod 700 "$WORK"; WORK=$(cd "$WORK" && pwd)
export FLWR_HOME="$WORK/flwr" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 PATH="$BIN:$PATH"
# The ServerApp (started by the SuperLink's SuperExec, with the SuperLink's environment) and
# the cloud service it starts read the operator's identities from here.
export EDGEFUSE_KEYS="$WORK/keys"
mkdir -p "$FLWR_HOME"
N=$("$BIN/python" -c "from edgefuse.config import compose; import sys; \
print(len(compose(sys.argv[1], sys.argv[2]).federation.clients))" "$EXPERIMENT" "$OVERRIDES")
PORT=${PORT:-19091}  # the SuperLink serves Fleet, Control and Runtime APIs on this port (flwr 1.42)
CERTS="$WORK/certs"

pids=()
tree() {  # a process's descendants, deepest first (SuperExec, ServerApp, ClientApp processes)
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$c"; echo "$c"; done
}
cleanup() {
  local p all=()
  for p in "${pids[@]}"; do all+=($(tree "$p") "$p"); done
  [ ${#all[@]} -gt 0 ] || return 0
  kill -TERM "${all[@]}" 2>/dev/null || true
  for _ in $(seq 20); do
    alive=0; for p in "${all[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break; sleep 0.5
  done
  kill -KILL "${all[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Identities of the cloud service and of every device: devices' homes are
# $WORK/keys/devices/partition-<i>, each with identity.key + trust.json.
"$BIN/edgefuse" keys init --partitions "$N" --root "$EDGEFUSE_KEYS" > "$WORK/keys.log"

if [ "$SECURE" = 1 ]; then
  "$BIN/edgefuse" deploy certs --out "$CERTS" > "$WORK/certs.log"
  "$BIN/edgefuse" deploy supernode-keys --out "$CERTS" --nodes "$N" >> "$WORK/certs.log"
  LINK_TLS=(--ssl-ca-certfile "$CERTS/ca.pem" --ssl-certfile "$CERTS/server.pem"
            --ssl-keyfile "$CERTS/server.key" --enable-supernode-auth)
  CONN="root-certificates = \"$CERTS/ca.pem\""
  SCHEME=https
else
  echo "[deploy] WARNING: --insecure: plain HTTP, any process can join as a SuperNode" >&2
  LINK_TLS=(--insecure); CONN="insecure = true"; SCHEME=http
fi
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "deploy"
[superlink.deploy]
address = "127.0.0.1:$PORT"
$CONN
EOF

flower-superlink "${LINK_TLS[@]}" --host 127.0.0.1 --port "$PORT" \
  --database "$WORK/state.db" > "$WORK/superlink.log" 2>&1 &
pids+=($!)
ready=0
for _ in $(seq 90); do  # wait until the SuperLink answers its health check (over TLS: the CA's)
  if "$BIN/python" - "$SCHEME://127.0.0.1:$PORT/health" "$CERTS/ca.pem" <<'PY' 2>/dev/null
import ssl, sys, httpx
url, ca = sys.argv[1], sys.argv[2]
verify = ssl.create_default_context(cafile=ca) if url.startswith("https") else False
sys.exit(not httpx.get(url, timeout=1, verify=verify).is_success)
PY
  then ready=1; break; fi
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 1
done
[ "$ready" = 1 ] || { echo "[deploy] the SuperLink did not come up; see $WORK/superlink.log" >&2; exit 1; }

for ((i = 0; i < N; i++)); do
  NODE=(--superlink "127.0.0.1:$PORT" --port $((PORT + 10 + i))
        --node-config "partition-id=$i num-partitions=$N device-dir=\"$EDGEFUSE_KEYS/devices/partition-$i\"")
  if [ "$SECURE" = 1 ]; then
    # The operator registers the node's public key on the SuperLink (Control API, over TLS)
    flwr supernode register "$CERTS/supernodes/partition-$i/node.pub" deploy \
      --name "partition-$i" >> "$WORK/register.log" 2>&1 \
      || { echo "[deploy] registering SuperNode $i failed; see $WORK/register.log" >&2; exit 1; }
    NODE+=(--root-certificates "$CERTS/ca.pem"
           --auth-supernode-private-key "$CERTS/supernodes/partition-$i/node.key")
  else
    NODE+=(--insecure)
  fi
  flower-supernode "${NODE[@]}" > "$WORK/supernode-$i.log" 2>&1 &
  pids+=($!)
done
online=0
for _ in $(seq 60); do  # wait until the SuperLink lists all N SuperNodes online
  online=$(flwr supernode list deploy --format json 2>/dev/null | "$BIN/python" -c \
    "import json, sys; print(sum(n['status'] == 'online' for n in json.load(sys.stdin)['nodes']))" \
    2>/dev/null || echo 0)
  [ "$online" = "$N" ] && break
  for p in "${pids[@]:1}"; do
    kill -0 "$p" 2>/dev/null || { echo "[deploy] a SuperNode exited; see $WORK/supernode-*.log" >&2; exit 1; }
  done
  sleep 2
done
[ "$online" = "$N" ] || { echo "[deploy] $online of $N SuperNodes online; see $WORK/supernode-*.log" >&2; exit 1; }
MODE=$([ "$SECURE" = 1 ] && echo "TLS + SuperNode authentication" || echo "INSECURE")
echo "[deploy] SuperLink ($MODE) + $N SuperNodes up on 127.0.0.1:$PORT; logs in $WORK"
if [ "$SERVE" = 1 ]; then
  echo "[deploy] ready: FLWR_HOME=$FLWR_HOME EDGEFUSE_KEYS=$EDGEFUSE_KEYS"
  wait "${pids[0]}"
  exit 1
fi
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
flwr run . deploy --stream --run-config "$WORK/run_config.toml" 2>&1 | tee "$WORK/run.log"
"$BIN/python" -c "import sys; from edgefuse.results import load_results; \
r = load_results(sys.argv[1]); print('[deploy] status:', r['status'], '-', sys.argv[1]); \
sys.exit(r['status'] != 'completed')" "$OUT"
