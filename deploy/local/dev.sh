#!/usr/bin/env bash
# `make dev`: the batch API and `dagster dev` on one local instance, started so that both
# come up every time, or neither.
#
# 1. The instance's storage is created first, by one process (`dagster instance migrate`).
#    The UI and the API starting together on a new DAGSTER_HOME used to create the SQLite
#    run and schedule storage at once: the loser died on `table alembic_version already
#    exists`, and a database could be left with two alembic heads, broken for good.
# 2. The batch API starts and is waited on; if it exits first (a taken port, a bad routing
#    table), this says so and stops, instead of a UI without its API.
# 3. `dagster dev` runs in the foreground; the API is stopped with it.
#
# Environment: PY, DAGSTER (the venv's python and dagster), GPUINFER_API_PORT (8001),
# DAGSTER_UI_PORT (3000), GPUINFER_API_WAIT_SECONDS (120).
set -euo pipefail

PY=${PY:-.venv/bin/python}
DAGSTER=${DAGSTER:-.venv/bin/dagster}
API_PORT=${GPUINFER_API_PORT:-8001}
UI_PORT=${DAGSTER_UI_PORT:-3000}
WAIT_SECONDS=${GPUINFER_API_WAIT_SECONDS:-120}
: "${DAGSTER_HOME:?DAGSTER_HOME must name the instance folder (make sets .dagster_home)}"

mkdir -p "$DAGSTER_HOME"
[ -f "$DAGSTER_HOME/dagster.yaml" ] || cp deploy/local/dagster.yaml "$DAGSTER_HOME/dagster.yaml"
"$DAGSTER" instance migrate >/dev/null

"$PY" -m dagster_gpuinfer.batch_api serve --routes assets.batch_pipelines:ROUTES \
    --port "$API_PORT" &
api=$!
trap 'kill "$api" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM

deadline=$((SECONDS + WAIT_SECONDS))
until "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$API_PORT/openapi.json" 2>/dev/null; do
    if ! kill -0 "$api" 2>/dev/null; then
        status=0
        wait "$api" || status=$?
        echo "make dev: the batch API exited (status $status) before it served on" \
            "127.0.0.1:$API_PORT; its error is above. dagster dev was not started." >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "make dev: the batch API did not answer on 127.0.0.1:$API_PORT within" \
            "${WAIT_SECONDS}s; dagster dev was not started." >&2
        exit 1
    fi
    sleep 0.5
done
echo "batch API on http://127.0.0.1:$API_PORT/v1 (OpenAPI: /docs)"

"$DAGSTER" dev -w workspace.yaml -p "$UI_PORT"
