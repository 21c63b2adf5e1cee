"""`kvtier serve`: an OpenAI-compatible HTTP server over the serving engine and the sparse path.

Layers, top to bottom (each module cares about one of them):

    app.py           FastAPI routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models,
                     /health, /metrics; Bearer auth (auth.py); OpenAI-style errors (error_responses.py)
    schemas.py       request bodies (pydantic): what is accepted, ignored, or refused as unsupported
    sampling.py      a body -> the engine's SamplingParams (vLLM's fields; response_format compiled)
    completion.py    one request end to end: its choices (choice.py: text with stop strings, text.py;
                     log-probabilities), response bodies and SSE chunks (shapes.py, logprobs.py), metrics
    backend.py       which path serves a request, and the context checks
    engine_loop.py   the continuous-batching engine (`kvtier.engine`) stepping on a background thread
    token_stream.py  token events handed from that thread to asyncio (loop.call_soon_threadsafe)
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
