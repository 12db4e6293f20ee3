#!/usr/bin/env bash
# Start (or reuse) a throwaway Prometheus server and Pushgateway on 127.0.0.1 for the test
# suite, and print the two `export` lines that point the tests at them:
#   eval "$(bash deploy/local/test-prometheus.sh)"
# Installs Debian's prometheus and prometheus-pushgateway packages when missing. Prometheus
# scrapes the Pushgateway every second (honor_labels, as for batch jobs) and keeps its data in
# /tmp. For tests only. `bash deploy/local/test-prometheus.sh stop` stops both.
set -euo pipefail
PROM_PORT=${GPUINFER_PROMETHEUS_PORT:-19090}
PUSH_PORT=${GPUINFER_PUSHGATEWAY_PORT:-19091}
DIR=${GPUINFER_PROMETHEUS_DIR:-/tmp/gpuinfer-prometheus-$PROM_PORT}
mkdir -p "$DIR"

if [ "${1:-}" = stop ]; then
  for name in prometheus pushgateway; do
    if [ -f "$DIR/$name.pid" ]; then
      pid=$(cat "$DIR/$name.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do  # Prometheus shuts down gracefully: wait until it is gone
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
      done
      rm -f "$DIR/$name.pid"
    fi
  done
  exit 0
fi

if ! command -v prometheus >/dev/null || ! command -v prometheus-pushgateway >/dev/null \
  || ! command -v promtool >/dev/null || ! command -v curl >/dev/null; then
  echo "installing prometheus, prometheus-pushgateway and curl (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends \
    prometheus prometheus-pushgateway curl >&2
fi

ready() { curl -fsS "http://127.0.0.1:$1/-/ready" >/dev/null 2>&1; }

wait_ready() {
  for _ in $(seq 1 100); do
    ready "$1" && return 0
    sleep 0.2
  done
  echo "$2 did not become ready on 127.0.0.1:$1; see $DIR/$2.log" >&2
  exit 1
}

if ! ready "$PUSH_PORT"; then
  nohup prometheus-pushgateway --web.listen-address="127.0.0.1:$PUSH_PORT" \
    >"$DIR/pushgateway.log" 2>&1 &
  echo $! >"$DIR/pushgateway.pid"
  wait_ready "$PUSH_PORT" pushgateway
fi

if ! ready "$PROM_PORT"; then
  cat >"$DIR/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: pushgateway
    honor_labels: true
    static_configs:
      - targets: ["127.0.0.1:$PUSH_PORT"]
EOF
  nohup prometheus --config.file="$DIR/prometheus.yml" --storage.tsdb.path="$DIR/data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$DIR/prometheus.log" 2>&1 &
  echo $! >"$DIR/prometheus.pid"
  wait_ready "$PROM_PORT" prometheus
fi

echo "export GPUINFER_TEST_PROMETHEUS_URL=http://127.0.0.1:$PROM_PORT"
echo "export GPUINFER_TEST_PUSHGATEWAY_URL=http://127.0.0.1:$PUSH_PORT"
