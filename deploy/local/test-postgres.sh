#!/usr/bin/env bash
# Start (or reuse) a throwaway PostgreSQL server on 127.0.0.1 for the test suite and print
# its URL. Installs Debian's postgresql package when no server binaries are found. The
# cluster lives in /tmp and trusts local connections only: it is for tests, nothing else.
set -euo pipefail
PORT=${GPUINFER_PG_PORT:-54329}
DATA=${GPUINFER_PG_DATA:-/tmp/gpuinfer-postgres-$PORT}

find_bin() {
  local name=$1 found
  found=$(command -v "$name" 2>/dev/null || true)
  if [ -z "$found" ]; then
    found=$(ls -1d /usr/lib/postgresql/*/bin/"$name" 2>/dev/null | sort -V | tail -n 1 || true)
  fi
  echo "$found"
}

if [ -z "$(find_bin initdb)" ]; then
  echo "installing postgresql (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq postgresql >&2
fi
INITDB=$(find_bin initdb)
PG_CTL=$(find_bin pg_ctl)

# shellcheck source=deploy/local/pg-cluster.sh
source "$(dirname "$0")/pg-cluster.sh"
start_cluster "$INITDB" "$PG_CTL" "$DATA" "$PORT"
