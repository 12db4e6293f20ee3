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

as_owner() {
  # PostgreSQL refuses to run as root: run it as the 'postgres' user then.
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    su postgres -s /bin/bash -c "$*"
  else
    bash -c "$*"
  fi
}

if [ ! -f "$DATA/PG_VERSION" ]; then
  mkdir -p "$DATA"
  [ "$(id -u)" = 0 ] && chown postgres "$DATA"
  as_owner "'$INITDB' -D '$DATA' -U gpuinfer --auth=trust -E UTF8" >&2
fi
if ! as_owner "'$PG_CTL' -D '$DATA' status" >/dev/null 2>&1; then
  as_owner "'$PG_CTL' -D '$DATA' -w -l '$DATA/server.log' -o \"-p $PORT -k /tmp -c listen_addresses=127.0.0.1\" start" >&2
fi
echo "postgresql://gpuinfer@127.0.0.1:$PORT/postgres"
