# Sourced by test-postgres.sh and test-pgvector.sh: start_cluster INITDB PG_CTL DATA PORT
# creates (once) and starts (unless running) a throwaway cluster on 127.0.0.1:PORT that
# trusts local connections, and prints its URL. PostgreSQL refuses to run as root: as root it
# runs as the 'postgres' user.

as_owner() {
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    su postgres -s /bin/bash -c "$*"
  else
    bash -c "$*"
  fi
}

start_cluster() {
  local initdb=$1 pg_ctl=$2 data=$3 port=$4
  if [ ! -f "$data/PG_VERSION" ]; then
    mkdir -p "$data"
    [ "$(id -u)" = 0 ] && chown postgres "$data"
    as_owner "'$initdb' -D '$data' -U gpuinfer --auth=trust -E UTF8" >&2
  fi
  if ! as_owner "'$pg_ctl' -D '$data' status" >/dev/null 2>&1; then
    as_owner "'$pg_ctl' -D '$data' -w -l '$data/server.log' -o \"-p $port -k /tmp -c listen_addresses=127.0.0.1\" start" >&2
  fi
  echo "postgresql://gpuinfer@127.0.0.1:$port/postgres"
}
