#!/usr/bin/env bash
# What tracing costs warren's consumer: row 3 of `billing bench` (warren with a
# one-insert handler, on PostgreSQL) in three builds and settings, ROUNDS
# rounds of each in turn (default 3), medians compared:
#   plain  billing built without the `otel` feature
#   off    billing built with it (the default), no OTLP endpoint: tracing off
#   on     the same binary exporting every span to an OTLP/HTTP sink on this
#          host (a few lines of Python that take and drop each request)
# Each run's figures: row 3's ratio of the bare drain measured in the same
# run, its msg/s, and the CPU warren's process spent per message. Fails if
# "off" costs more than 2% more CPU per message than "plain" (median of the
# rounds). Throughput is printed, not gated: on two shared cores it spread by
# a fifth between runs of one build (3 606 to 5 049 msg/s, and a third for
# the ratio to the bare drain), ten times the 2% asked, while CPU per message
# stayed within a few percent: the gate is on what the code costs, which is
# what throughput is made of on a machine whose cores are busy.
#
#   benches/otel_overhead.sh            # MESSAGES=20000 ROUNDS=3 by default
set -euo pipefail
cd "$(dirname "$0")/.."
MESSAGES=${MESSAGES:-20000}
ROUNDS=${ROUNDS:-3}
work=$(mktemp -d)

echo "building billing without and with the otel feature (release)" >&2
cargo build --quiet --release -p billing --no-default-features
cp target/release/billing "$work/billing-plain"
cargo build --quiet --release -p billing
cp target/release/billing "$work/billing-otel"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 - "$port" <<'PY' &
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
PY
sink=$!
trap 'kill $sink 2>/dev/null; rm -rf "$work"' EXIT

# run VARIANT BINARY [ENV...]: one bench run; appends "ratio rate cpu" to
# VARIANT's file.
run() {
  local variant=$1 binary=$2
  shift 2
  env -u OTEL_EXPORTER_OTLP_ENDPOINT -u OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "$@" \
    "$binary" bench --messages "$MESSAGES" --rows 3 --databases postgres >"$work/out" 2>"$work/err" ||
    { cat "$work/out" "$work/err" >&2; exit 1; }
  python3 - "$work/out" >>"$work/$variant" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
row3 = [l for l in lines if "3  warren, one-insert handler" in l]
start = next(i for i, l in enumerate(lines) if "row 3, warren with a one-insert handler" in l)
cpu = next(l for l in lines[start:] if "CPU per message: this process" in l)
if not row3:
    sys.exit("no row 3 in the bench's output")
rate, ratio = re.findall(r"\d+(?:\.\d+)?", row3[0].split("handler", 1)[1])[:2]
print(ratio, rate, re.search(r"this process (\d+) µs", cpu).group(1))
PY
  echo "round $round $variant: $(tail -n 1 "$work/$variant")" >&2
}

for round in $(seq 1 "$ROUNDS"); do
  run plain "$work/billing-plain"
  run off "$work/billing-otel"
  run on "$work/billing-otel" OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$port"
done

python3 - "$work" <<'PY'
import statistics, sys
work = sys.argv[1]
median = {}
cpu = {}
for v in ("plain", "off", "on"):
    runs = [tuple(map(float, l.split())) for l in open(f"{work}/{v}")]
    median[v] = statistics.median(r[0] for r in runs)
    cpu[v] = statistics.median(r[2] for r in runs)
    rates = ", ".join(f"{r[1]:.0f}" for r in runs)
    print(f"row 3 {v:5}: median {median[v]:.3f} of the bare drain, {cpu[v]:.0f} µs of CPU "
          f"per message in warren's process (msg/s per run: {rates})")
off = median["off"] / median["plain"]
on = median["on"] / median["off"]
cpu_off = cpu["off"] / cpu["plain"]
print(f"otel build, tracing off / build without otel: CPU per message {cpu_off:.3f} "
      f"(at most 1.02 required); row 3's ratio of the bare drain {off:.3f}")
print(f"tracing on (every span exported) / tracing off: {on:.3f}; "
      f"CPU per message {cpu['on'] / cpu['off']:.3f} of it")
sys.exit(0 if cpu_off <= 1.02 else 1)
PY
