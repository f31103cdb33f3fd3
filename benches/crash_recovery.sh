#!/usr/bin/env bash
# What a crash costs at a prefetch: `billing run` (release) on PostgreSQL drains
# a queue of MESSAGES invoices, is killed with SIGKILL once about half of them
# are applied, and is started again. Prints, for the second process: the time
# from its start until every invoice is applied, how many deliveries came back
# redelivered, how many of them ran alone (their claim had not committed: a
# suspect's solo run) and how many settled as duplicates without one (their
# claim had committed; their ack died with the process). Fails unless each
# invoice credited its loyalty points exactly once.
#
#   PREFETCH=256 MESSAGES=20000 benches/crash_recovery.sh
#
# Needs the services of .ci/run (RabbitMQ with the consistent-hash plugin,
# PostgreSQL) and psql; makes a schema and a prefix of its own and removes them.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFETCH=${PREFETCH:-256}
MESSAGES=${MESSAGES:-20000}
PG=${PG:-postgres://postgres@127.0.0.1:5432/postgres}
tag=crash$(date +%s)$RANDOM
schema=$tag
work=$(mktemp -d)

cargo build --quiet --release -p billing
billing=target/release/billing
psql -qAtX "$PG" -c "CREATE SCHEMA $schema" >/dev/null
url="$PG?sslmode=disable&options=-c%20search_path%3D$schema"
export BILLING_PREFIX=$tag DATABASE_URL=$url RUST_LOG=info,warren::telemetry=debug

cleanup() {
  [ -n "${pid:-}" ] && kill -KILL "$pid" 2>/dev/null || true
  psql -qAtX "$PG" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null || true
  for q in $(rabbitmqctl -q list_queues name 2>/dev/null | grep "^$tag\." || true); do
    rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true
  done
  rabbitmqctl -q eval "rabbit_exchange:delete(rabbit_misc:r(<<\"/\">>, exchange, <<\"$tag.events\">>), false, <<\"bench\">>)." >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
applied() { psql -qAtX "$PG" -c "SELECT count(*) FROM $schema.loyalty_points" 2>/dev/null || echo 0; }
# The port is found before the fork, and the child drops the EXIT trap: a
# signal that reached the forked shell before it became billing would
# otherwise run the cleanup there, removing the logs mid-run.
start() {
  local http
  http=127.0.0.1:$(port)
  (trap - EXIT; exec "$billing" --prefetch "$PREFETCH" --http "$http" --log-format json run >"$1" 2>&1) &
  pid=$!
}

# The first process declares the topology and creates the tables, and
# stops; the invoices go in while nothing consumes them (a consumer running
# beside the publisher keeps up with it, and would have applied them all
# before the kill). The second is killed once about half are applied.
start "$work/first.log"
for _ in $(seq 1 300); do grep -qs '"consuming"' "$work/first.log" && break; sleep 0.1; done
kill -TERM "$pid"
wait "$pid" 2>/dev/null || true
"$billing" --prefetch "$PREFETCH" publish --count "$MESSAGES" --duplicates 0 --v2 0 --poison 0 --flaky 0 >/dev/null
start "$work/killed.log"
for _ in $(seq 1 3000); do [ "$(applied)" -ge $((MESSAGES / 2)) ] && break; sleep 0.01; done
kill -KILL "$pid"
wait "$pid" 2>/dev/null || true
at_kill=$(applied)

started=$(date +%s.%N)
start "$work/second.log"
for _ in $(seq 1 12000); do [ "$(applied)" -ge "$MESSAGES" ] && break; sleep 0.01; done
finished=$(date +%s.%N)
kill -TERM "$pid"
wait "$pid" 2>/dev/null || true
pid=

python3 - "$work/second.log" "$MESSAGES" "$at_kill" "$started" "$finished" "$PREFETCH" <<'PY'
import json, sys
log, n, at_kill, started, finished, prefetch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
redelivered = solo = duplicates = 0
for line in open(log):
    try:
        event = json.loads(line)
    except ValueError:
        continue
    fields = event.get("fields", {})
    if fields.get("message") == "suspect runs alone":
        solo += 1
    if fields.get("message") == "message processed" and fields.get("rabbitmq_redelivered"):
        redelivered += 1
        if fields.get("processing_result") == "duplicate":
            duplicates += 1
print(f"prefetch {prefetch}: {at_kill} of {n} applied when the first process was killed; the second "
      f"applied the rest in {finished - started:.2f} s from its start (connecting and migrating included): "
      f"{redelivered} deliveries came back redelivered, {solo} ran alone as suspects, "
      f"{duplicates} settled as duplicates without a solo run")
PY
rows=$(psql -qAtX "$PG" -c "SELECT count(*), count(DISTINCT message_id) FROM $schema.loyalty_points")
echo "loyalty rows, distinct messages: $rows (expected $MESSAGES|$MESSAGES)"
[ "$rows" = "$MESSAGES|$MESSAGES" ]
