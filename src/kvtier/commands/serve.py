"""`kvtier serve`: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics).

Requests are batched by the serving engine (the options of `kvtier batch`: swap to flash, DRAM or
recompute); a prompt too long for the engine's device pool is served on the HillInfer sparse path,
one at a time, reusing the prefill KV of documents stored by earlier requests (the document KV
store). Binds to 127.0.0.1 unless --host says otherwise; --api-key (or KVTIER_API_KEY) makes every
endpoint but /health require `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.commands.serve_options import add_engine_options, engine_config_from
from kvtier.commands.store_options import add_store_options, store_from
from kvtier.errors import ConfigError
from kvtier.modes import KVConfig

DEFAULT_PORT = 8000


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server over the serving engine",
                                   description=__doc__.split("\n\n")[1])
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
    sparse = parser.add_argument_group("long prompts (the sparse path)")
    sparse.add_argument("--no-sparse", dest="sparse", action="store_false",
                        help="refuse prompts beyond the device pool instead of serving them on the sparse path")
    defaults = KVConfig()
    sparse.add_argument("--sparse-device-kv-budget", default=defaults.device_kv_budget,
                        help="sparse path: KV bytes on the device (default %(default)s)")
    sparse.add_argument("--sparse-host-kv-budget", default=defaults.host_kv_budget,
                        help="sparse path: KV bytes in host DRAM (default %(default)s)")
    sparse.add_argument("--storage-dir", default=None,
                        help="sparse path: directory of its cold-pool files (default: <user cache>/kvtier/kv)")
    add_store_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvtier.models.loader import load_model
    from kvtier.http.app import create_app
    from kvtier.http.backend import ServerSettings, SparseSetup, build_backend
    from kvtier.http.runner import serve_forever

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0-65535, got {args.port}")
    if args.default_max_tokens < 1:
        raise ConfigError(f"--default-max-tokens must be positive, got {args.default_max_tokens}")
    engine_config = engine_config_from(args)
    sparse_kv = KVConfig(kv="sparse", device_kv_budget=args.sparse_device_kv_budget,
                         host_kv_budget=args.sparse_host_kv_budget, storage_dir=args.storage_dir).validated()
    settings = ServerSettings(args.served_model_name or args.model, args.api_key or None, args.default_max_tokens)
    llm = load_model(args.model, dtype=args.dtype)
    sparse = None
    if args.sparse:
        sparse = SparseSetup(sparse_kv, lambda: load_model(args.model, dtype=args.dtype), store_from(args))
    backend = build_backend(llm, engine_config, settings, sparse)
    print(f"[serve] {settings.model_name} on http://{args.host}:{args.port} | engine: "
          f"{backend.engine.pool.num_blocks} blocks of {engine_config.block_tokens} tokens, swap {engine_config.swap}"
          f" | long prompts: {'sparse path' if args.sparse else 'refused'}"
          f"{' | API key required' if args.api_key else ''}", file=sys.stderr, flush=True)
    serve_forever(create_app(backend), args.host, args.port, args.graceful_shutdown,
                  grace_over=backend.fail_unfinished)
    return 0
