#!/usr/bin/env bash
# Start (or reuse) a throwaway PostgreSQL server with the pgvector extension on 127.0.0.1 for
# the sink tests, and print its URL. Debian's postgresql packages carry no pgvector here, so
# the server binaries come from the `pgserver` wheel (pinned in the test extra: PostgreSQL
# 16 with pgvector built in), found through the project's interpreter ($PY). The cluster
# lives in /tmp and trusts local connections only: it is for tests, nothing else.
#   GPUINFER_TEST_PGVECTOR_URL=$(PY=.venv/bin/python bash deploy/local/test-pgvector.sh)
set -euo pipefail
PY=${PY:-python3}
PORT=${GPUINFER_PGVECTOR_PORT:-54339}
DATA=${GPUINFER_PGVECTOR_DATA:-/tmp/gpuinfer-pgvector-$PORT}

if ! HOME_DIR=$("$PY" -c 'import os, pgserver; print(os.path.dirname(pgserver.__file__))' \
  2>/dev/null); then
  echo "pgserver is not installed in $PY's environment: install the test extra" \
    "(pip install -c requirements/lock-cpu.txt -e '.[test]')" >&2
  exit 1
fi
if [ ! -f "$HOME_DIR/pginstall/share/postgresql/extension/vector.control" ]; then
  echo "the pgserver wheel in $HOME_DIR carries no pgvector extension" >&2
  exit 1
fi
# The server runs as 'postgres' when this runs as root, and a checkout under /root (mode
# 700) hides the venv from that user: run a world-readable copy of the binaries from /tmp.
# The binaries find their libraries at $ORIGIN/../../../pgserver.libs: keep that layout.
VERSION=$("$PY" -c 'from importlib.metadata import version; print(version("pgserver"))')
INSTALL=/tmp/gpuinfer-pgserver-$VERSION
if [ ! -x "$INSTALL/pgserver/pginstall/bin/initdb" ]; then
  rm -rf "$INSTALL.partial"
  mkdir -p "$INSTALL.partial/pgserver"
  cp -r "$HOME_DIR/pginstall" "$INSTALL.partial/pgserver/pginstall"
  cp -r "$(dirname "$HOME_DIR")/pgserver.libs" "$INSTALL.partial/pgserver.libs"
  chmod -R a+rX "$INSTALL.partial"
  rm -rf "$INSTALL"
  mv "$INSTALL.partial" "$INSTALL"
fi
BIN="$INSTALL/pgserver/pginstall/bin"

# shellcheck source=deploy/local/pg-cluster.sh
source "$(dirname "$0")/pg-cluster.sh"
start_cluster "$BIN/initdb" "$BIN/pg_ctl" "$DATA" "$PORT"
