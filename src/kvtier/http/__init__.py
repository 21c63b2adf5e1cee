"""`kvtier serve`: an OpenAI-compatible HTTP server over the serving engine and the sparse path.

Layers, top to bottom (each module cares about one of them):

    app.py           FastAPI routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models,
                     /health, /metrics; Bearer auth (auth.py); OpenAI-style errors (errors.py)
    schemas.py       request bodies (pydantic): what is accepted, what is refused as unsupported
    completion.py    one request end to end: prompt ids, a token stream, text with stop strings
                     (text.py), response bodies and SSE chunks, latency metrics
    backend.py       which path serves a request, and the context checks
    engine_loop.py   the continuous-batching engine (`kvtier.engine`) stepping on a background thread
    sparse_path.py   prompts beyond the engine's paged budget: one at a time on the HillInfer sparse path
    token_stream.py  tokens handed from those threads to asyncio (loop.call_soon_threadsafe)
    metrics.py       Prometheus metrics with a `kvtier:` prefix
    runner.py        uvicorn: `kvtier serve` in the foreground, or a server thread (tests, benchmark)

Which path serves what: a request whose prompt plus `max_tokens` fits the engine's device pool
goes to the engine, batched with every other such request and swapped to flash (or DRAM) under
pressure as in `kvtier batch`. A longer one would be refused by the engine; it runs instead on the
sparse path (`--kv sparse`: device window, host hot pool, cold pool on disk scored by the storage
scorer), one request at a time, with a model instance of its own because each path installs its
own attention implementation on the model. With the document KV store (`kvtier.docstore`, on by
default in `kvtier serve`), a sparse request whose prompt starts with blocks stored by an earlier
request loads them instead of prefilling them; engine requests prefill their (short) prompts.
"""
