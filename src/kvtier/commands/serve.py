"""`kvtier serve`: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics).

Every request is batched by the serving engine (the options of `kvtier batch`: swap to flash, DRAM
or recompute); a prompt too long for the engine's device pool decodes in the same batches as a
tiered sequence (HillInfer's tiers: device window, host hot pool, cold pool on flash), reusing the
prefill KV of documents stored by earlier requests (the document KV store). Binds to 127.0.0.1 unless
--host says otherwise, before the model loads (a port in use is refused at once); --api-key (or
KVTIER_API_KEY) makes every endpoint but /health require `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.commands.serve_options import add_engine_options, engine_config_from, tiers_from
from kvtier.commands.store_options import add_store_options, store_from
from kvtier.docstore.document_store import DocumentStore
from kvtier.engine.config import EngineConfig
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvtier.http.backend import Backend

DEFAULT_PORT = 8000


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", description=__doc__.split("\n\n")[1])
    add_model_option(parser)
    add_dtype_option(parser)
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: loopback only)")
    http.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s; 0: any free port)")
    http.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY"),
                      help="require `Authorization: Bearer KEY` on every endpoint but /health "
                           "(default: $KVTIER_API_KEY, unset: no key)")
    http.add_argument("--served-model-name", default=None,
                      help="the model name clients send (default: the --model value)")
    http.add_argument("--default-max-tokens", type=int, default=256,
                      help="max_tokens of a request that gives none (default %(default)s)")
    http.add_argument("--graceful-shutdown", type=float, default=30.0,
                      help="seconds in-flight requests get to finish after SIGTERM (default %(default)s)")
    add_engine_options(parser)
    add_store_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0-65535, got {args.port}")
    if args.default_max_tokens < 1:
        raise ConfigError(f"--default-max-tokens must be positive, got {args.default_max_tokens}")
    engine_config = engine_config_from(args)
    store = store_from(args)
    from kvtier.http.runner import bind, serve_forever  # only now: uvicorn and the model's imports take seconds

    sock = bind(args.host, args.port)  # before the model loads: an address in use fails now, not seconds later
    try:
        app, backend = _served(args, engine_config, store)
    except BaseException:
        sock.close()
        raise
    long_prompts = f"tiered, up to {engine_config.max_tiered_seqs} at once" if args.sparse else "refused"
    print(f"[serve] {backend.settings.model_name} on http://{args.host}:{sock.getsockname()[1]} | engine: "
          f"{backend.engine.pool.num_blocks} blocks of {engine_config.block_tokens} tokens, swap {engine_config.swap}"
          f" | long prompts: {long_prompts}"
          f"{' | API key required' if args.api_key else ''}", file=sys.stderr, flush=True)
    serve_forever(app, sock, args.graceful_shutdown, grace_over=backend.fail_unfinished)
    return 0


def _served(args: argparse.Namespace, engine_config: EngineConfig,
            store: DocumentStore | None) -> tuple[FastAPI, Backend]:
    """(the FastAPI app, its Backend) over the model the options name, loaded now."""
    from kvtier.http.app import create_app
    from kvtier.http.backend import ServerSettings, build_backend
    from kvtier.models.loader import load_model

    settings = ServerSettings(args.served_model_name or args.model, args.api_key or None, args.default_max_tokens)
    llm = load_model(args.model, dtype=args.dtype)
    backend = build_backend(llm, engine_config, settings, tiers_from(args, llm, store))
    return create_app(backend), backend
