#!/usr/bin/env bash
# The cost of authentication (issue 22): this checkout's `kvfence serve` (cluster key, CURVE control plane, MAC'd
# frames, transfer capabilities) against a checkout from before authentication, 1 prefill + 1 decode each, the same
# box, interleaved rounds of `kvfence bench serve` at concurrency 1 and 8.
#   git worktree add --detach /tmp/kvfence-before-auth 830ecb4
#   scripts/bench_auth_cost.sh /tmp/kvfence-before-auth [extra serve args, e.g. --transfer-backend mooncake]
set -euo pipefail
BEFORE="$(cd "$1" && pwd)"
shift
CONCURRENCY="${CONCURRENCY:-1 8}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
P_OLD=$(free_port); P_NEW=$(free_port)
LOGS=$(mktemp -d)
(cd "$BEFORE" && PYTHONPATH="$BEFORE" exec kvfence serve --port "$P_OLD" "$@" >"$LOGS/before.log" 2>&1) & OLD=$!
(cd "$HERE" && PYTHONPATH="$HERE" exec kvfence serve --port "$P_NEW" "$@" >"$LOGS/auth.log" 2>&1) & NEW=$!
trap 'kill $OLD $NEW 2>/dev/null || true' EXIT
for p in "$P_OLD" "$P_NEW"; do
  for _ in $(seq 1 300); do curl -sf "127.0.0.1:$p/health" >/dev/null && break; sleep 1; done
done
for c in $CONCURRENCY; do
  echo "=== max-concurrency $c"
  PYTHONPATH="$HERE" kvfence bench serve --url "before-auth=http://127.0.0.1:$P_OLD" --url "auth=http://127.0.0.1:$P_NEW" \
    --num-prompts 48 --max-concurrency "$c" --request-rate inf --input-len 128 --output-len 64 --warmup 4 --rounds 3
done
