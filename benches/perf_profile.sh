#!/usr/bin/env bash
# Where warren's process spends its CPU: `billing run` (release) on PostgreSQL
# drains a queue of MESSAGES invoices filled before it starts, while `perf
# record` samples it (cpu-clock, so it works where the CPU's own counters are
# not available, and it sees the kernel's side of every socket call). Prints
# the CPU per message the process spent, the functions most samples were
# taken in, and the same samples grouped by what they belong to (the kernel,
# sqlx, lapin, tokio, warren, ...).
#
#   MESSAGES=100000 benches/perf_profile.sh
#
# Needs perf (Debian's linux-perf), psql and the services of .ci/run; makes a
# schema and a prefix of its own and removes them. PERF_DATA keeps the
# recording (default: removed); PERF_CALLERS=1 records call chains too
# (DWARF), to read with `perf report -i $PERF_DATA --no-children -G`.
set -euo pipefail
cd "$(dirname "$0")/.."
MESSAGES=${MESSAGES:-100000}
PG=${PG:-postgres://postgres@127.0.0.1:5432/postgres}
tag=prof$(date +%s)$RANDOM
schema=$tag
work=$(mktemp -d)
data=${PERF_DATA:-$work/perf.data}

command -v perf >/dev/null || { echo "perf is missing: apt-get install linux-perf" >&2; exit 1; }
cargo build --quiet --release -p billing
billing=target/release/billing
psql -qAtX "$PG" -c "CREATE SCHEMA $schema" >/dev/null
url="$PG?sslmode=disable&options=-c%20search_path%3D$schema"
export BILLING_PREFIX=$tag DATABASE_URL=$url

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
# The port is found before the fork, and the child drops the EXIT trap (a
# signal reaching the forked shell before it became billing would run the
# cleanup there).
start() {
  local http
  http=127.0.0.1:$(port)
  (trap - EXIT; exec "$billing" --http "$http" run >"$1" 2>&1) &
  pid=$!
  for _ in $(seq 1 300); do grep -qs 'consuming' "$1" && return 0; sleep 0.1; done
  echo "billing run did not start consuming; its log:" >&2
  cat "$1" >&2
  return 1
}
stop() {
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
}

# The first process declares the topology and creates the tables; the queue
# is filled while nothing consumes it.
start "$work/first.log"
stop
"$billing" publish --count "$MESSAGES" --duplicates 0 --v2 0 --poison 0 --flaky 0 >/dev/null

start "$work/second.log"
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
before=$(cpu)
callers=()
[ "${PERF_CALLERS:-0}" = 1 ] && callers=(--call-graph dwarf,16384 -F 499) || callers=(-F 1999)
perf record -q -e cpu-clock "${callers[@]}" -p "$pid" -o "$data" 2>/dev/null &
perf_pid=$!
started=$(date +%s.%N)
# A count of a growing table every 0.2 s: the poll costs the database little
# beside the run, and adds at most 0.2 s to its time.
for _ in $(seq 1 15000); do [ "$(applied)" -ge "$MESSAGES" ] && break; sleep 0.2; done
finished=$(date +%s.%N)
after=$(cpu)
kill -INT "$perf_pid"
wait "$perf_pid" 2>/dev/null || true
stop
python3 -c "import sys; n, t, c, s, f = map(float, sys.argv[1:]); \
print(f'{int(n)} invoices in {f - s:.1f} s ({n / (f - s):.0f}/s); billing run spent {c / t * 1e6 / n:.1f} µs of CPU per invoice')" \
  "$MESSAGES" "$ticks" "$((after - before))" "$started" "$finished"

perf report -i "$data" --no-children --sort dso,sym --stdio -g none --percent-limit 0 2>/dev/null |
  python3 -c '
import re, sys
rows = []
for line in sys.stdin:
    m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)", line)
    if m:
        rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4).strip()))
print("\nfunctions most samples were taken in (self):")
for share, dso, kind, sym in rows[:20]:
    print(f"  {share:5.1f}%  {sym[:100]}" + ("  [kernel]" if kind == "k" else ""))
groups = [
    ("the kernel (sockets, scheduling, futexes)", lambda d, k, s: k == "k"),
    ("sqlx (PostgreSQL protocol, pool)", lambda d, k, s: "sqlx" in s),
    ("lapin and amq-protocol (AMQP frames)", lambda d, k, s: any(x in s for x in ("lapin", "amq_protocol", "nom::", "cookie_factory"))),
    ("tokio and mio (scheduler, timers, I/O readiness)", lambda d, k, s: any(x in s for x in ("tokio", "mio::"))),
    ("warren (frame guard, pipeline, acks, relay)", lambda d, k, s: "warren" in s),
    ("serde_json (envelopes, payloads)", lambda d, k, s: "serde_json" in s or "serde::" in s),
    ("tracing and metrics", lambda d, k, s: any(x in s for x in ("tracing", "metrics"))),
    ("memory (malloc, free, copies)", lambda d, k, s: any(x in s for x in ("malloc", "free", "memcpy", "memmove", "memset", "realloc", "alloc::", "cfree", "_int_"))),
]
totals = {name: 0.0 for name, _ in groups}
rest = 0.0
for share, dso, kind, sym in rows:
    for name, test in groups:
        if test(dso, kind, sym):
            totals[name] += share
            break
    else:
        rest += share
print("\nthe same samples by what they belong to:")
for name, _ in groups:
    print(f"  {totals[name]:5.1f}%  {name}")
print(f"  {rest:5.1f}%  the rest (libc, the standard library, other crates)")
'
rows=$(psql -qAtX "$PG" -c "SELECT count(*), count(DISTINCT message_id) FROM $schema.loyalty_points")
[ "$rows" = "$MESSAGES|$MESSAGES" ] || { echo "loyalty rows, distinct messages: $rows (expected $MESSAGES|$MESSAGES)" >&2; exit 1; }
