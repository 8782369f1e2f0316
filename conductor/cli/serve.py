"""``conductor serve``: the OpenAI Files and Batches API (conductor/api/) over HTTP, until a signal
(kept apart from cli/main.py, which only calls in)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from conductor.cli.args import port
from conductor.errors import ConductorError


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from conductor.api.app import make_app
    except ImportError as e:
        raise ConductorError(f"conductor serve needs the serve extra (pip install 'conductor[serve]'): {e}") from None
    from conductor.cli.connect import url_from
    keys = list(args.api_key) + [k for k in os.environ.get("CONDUCTOR_API_KEYS", "").split(",") if k.strip()]
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConductorError("--tls-cert and --tls-key go together (the certificate chain and its private key)")
    for path in (args.tls_cert, args.tls_key):
        if path and not os.path.isfile(path):
            raise ConductorError(f"no such file: {path}")
    from conductor.tier.object_store import store_from
    app = make_app(url_from(args), data_dir=args.data_dir, api_keys=[k.strip() for k in keys],
                   segment_store=store_from(getattr(args, "store", None)))
    scheme = "https" if args.tls_cert else "http"
    # the first line says who may use this replica: an open one is worth knowing about at once
    book = app.state.keys
    if book.open():
        who = "OPEN: no API keys in Redis and no --api-key, anyone who reaches this port may use it " \
              "(conductor keys create --tenant T makes one; every replica then asks for keys)"
    else:
        parts = (["the API keys in Redis"] if book.has_stored() else []) + \
            ([f"{len(book.static)} --api-key (admin, tenant default)"] if book.static else [])
        who = "keys: " + " and ".join(parts)
    print(f"conductor serve: {scheme}://{args.host}:{args.port}/v1 {who} (files in {app.state.store.root})",
          file=sys.stderr, flush=True)
    # uvicorn re-raises a signal it stopped on once it has shut down, under the handler it found
    # installed: a SIGTERM is a clean stop (status 0, as for the worker and the exporter), and one
    # that comes before uvicorn takes the signal over stops serve at once, as cleanly.
    signal.signal(signal.SIGTERM, _stop_cleanly)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", ssl_certfile=args.tls_cert,
                ssl_keyfile=args.tls_key)
    return 0


def _stop_cleanly(_sig: int, _frame: object) -> None:
    raise SystemExit(0)


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    s = command("serve", "serve OpenAI's Files and Batches API at /v1 and a status page at /", cmd_serve)
    s.add_argument("--port", type=port, default=8000, help="TCP port")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="an admin key of the default tenant, beside the keys in Redis (conductor keys create); "
                        "repeatable; also env CONDUCTOR_API_KEYS, comma separated. With neither: no authentication")
    s.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM, chain included)")
    s.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    s.add_argument("--data-dir", metavar="DIR",
                   help="where uploaded file bytes are kept (shared by every replica; default: "
                        "$XDG_DATA_HOME/conductor/files or ~/.local/share/conductor/files)")
