"""`python -m dagster_gpuinfer.batch_api`: serve the API, and create, list and revoke keys.

python -m dagster_gpuinfer.batch_api serve --routes assets.batch_pipelines:ROUTES
python -m dagster_gpuinfer.batch_api keys create --tenant acme --queue acme-gpu
python -m dagster_gpuinfer.batch_api keys list
python -m dagster_gpuinfer.batch_api keys revoke KEY_ID
python -m dagster_gpuinfer.batch_api webhooks secret
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from dagster_gpuinfer.batch_api import settings
from dagster_gpuinfer.batch_api.store import BatchStore


def build_service(
    routes_source: str | None,
    store_url: str | None,
    files_root: str | None,
    webhooks_source: str | None = None,
    limits_source: str | None = None,
):
    """The service from the environment (settings.py), overridden by the given arguments.

    Raises:
        ValueError: the webhook or limit settings are not valid, an endpoint's secret
            variable is unset or not a `whsec_` secret, or a route's pgvector sink's URL
            variable is unset.
    """
    import dagster as dg

    from dagster_gpuinfer.batch_api.files import FileBytes
    from dagster_gpuinfer.batch_api.limits import load_limit_settings
    from dagster_gpuinfer.batch_api.routing import load_routing_table
    from dagster_gpuinfer.batch_api.service import BatchService
    from dagster_gpuinfer.batch_api.webhooks import load_webhook_settings

    webhooks = load_webhook_settings(webhooks_source)
    webhooks.check_secrets()
    routes = load_routing_table(routes_source)
    routes.check_sink_variables()
    return BatchService(
        store=BatchStore(store_url or settings.store_url()),
        files=FileBytes(files_root or settings.files_root(), settings.storage_options()),
        routes=routes,
        instance=dg.DagsterInstance.get(),
        webhooks=webhooks,
        limits=load_limit_settings(limits_source),
    )


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from dagster_gpuinfer.batch_api.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    service = build_service(
        args.routes, args.store_url, args.files_root, args.webhooks, args.limits
    )
    app = create_app(service, reconcile_interval=args.reconcile_interval)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def keys(args: argparse.Namespace) -> int:
    store = BatchStore(args.store_url or settings.store_url())
    try:
        if args.keys_command == "create":
            key = store.create_key(args.tenant, kueue_queue=args.queue)
            print(json.dumps({"key_id": key.key_id, "tenant": args.tenant, "api_key": key.token}))
            print("Store the api_key now: only its hash is kept.", file=sys.stderr)
        elif args.keys_command == "revoke":
            if not store.revoke_key(args.key_id):
                print(f"no active key {args.key_id!r}; see `keys list`", file=sys.stderr)
                return 1
            print(json.dumps({"key_id": args.key_id, "revoked": True}))
        else:
            for row in store.list_keys():
                print(json.dumps(row))
    finally:
        store.close()
    return 0


def webhooks(args: argparse.Namespace) -> int:
    from dagster_gpuinfer.batch_api.webhooks import new_secret

    print(new_secret())
    print(
        "Put it in the environment variable the endpoint's secret_env names, and give it to "
        "the receiver (openai SDK: client.webhooks.unwrap(body, headers, secret=...)).",
        file=sys.stderr,
    )
    return 0


def _positive_seconds(text: str) -> float:
    seconds = float(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(
            f"{text} is not a positive number of seconds: batches move only through the "
            "reconcile loop (GETs read what it wrote), so give it an interval, e.g. 5"
        )
    return seconds


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m dagster_gpuinfer.batch_api")
    top.add_argument("--store-url", help=f"metadata store URL (default ${settings.STORE_URL_ENV})")
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="serve /v1/files and /v1/batches")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8001)
    run.add_argument("--routes", help="routing table: YAML path or module:attribute")
    run.add_argument("--files-root", help=f"file bytes root (default ${settings.FILES_ROOT_ENV})")
    run.add_argument(
        "--reconcile-interval",
        type=_positive_seconds,
        default=5.0,
        help="seconds between passes that bring batches up to date with their runs "
        "(GETs show what the last pass wrote)",
    )
    run.add_argument(
        "--webhooks",
        help="webhook endpoints per tenant: YAML path (default $GPUINFER_BATCH_WEBHOOKS)",
    )
    run.add_argument(
        "--limits",
        help="per-tenant rate limits and quotas: YAML path (default $GPUINFER_BATCH_LIMITS; "
        "without one, the defaults of dagster_gpuinfer/batch_api/limits.py)",
    )
    run.set_defaults(handler=serve)
    key_parser = commands.add_parser("keys", help="create, list or revoke API keys")
    key_commands = key_parser.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="a new key for a tenant (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--queue", help="the tenant's Kueue LocalQueue")
    revoke = key_commands.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    key_commands.add_parser("list", help="key ids, tenants, created and revoked times")
    key_parser.set_defaults(handler=keys)
    hook_parser = commands.add_parser("webhooks", help="webhook signing secrets")
    hook_commands = hook_parser.add_subparsers(dest="webhooks_command", required=True)
    hook_commands.add_parser("secret", help="print a new whsec_ signing secret")
    hook_parser.set_defaults(handler=webhooks)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
