"""Highly repetitive prose: the templated sentences that logs and forms are made of, from a fixed seed.

A handful of sentence templates with a few slots each (a time, a worker, a request number, a status, a duration),
so that most of every sentence repeats hundreds of times and only its numbers change: the kind of document where
attention is spread over many look-alike tokens rather than peaked on a few.
"""

import random

TEMPLATED_SEED = 0

_SERVICES = ("orders", "billing", "search", "accounts", "inventory")
_STATUSES = ("completed", "completed", "completed", "was retried", "failed")
_TEMPLATES = (
    "At {hour:02d}:{minute:02d} worker {worker} of the {service} service handled request {request} and the request "
    "{status} after {ms} milliseconds.",
    "Form {request} was submitted by customer {customer} for the {service} department and it {status}.",
    "The {service} queue held {depth} items at {hour:02d}:{minute:02d}, and worker {worker} took the next one.",
    "Customer {customer} asked the {service} desk about request {request}; the answer was sent after {ms} "
    "milliseconds.",
)


def _sentence(rng: random.Random) -> str:
    slots = {"hour": rng.randrange(24), "minute": rng.randrange(60), "worker": rng.randrange(1, 9),
             "service": rng.choice(_SERVICES), "request": rng.randrange(1000, 10000),
             "status": rng.choice(_STATUSES), "ms": rng.randrange(5, 500), "customer": rng.randrange(100, 1000),
             "depth": rng.randrange(1, 100)}
    return rng.choice(_TEMPLATES).format(**slots)


def templated_text(min_chars: int, seed: int = TEMPLATED_SEED) -> str:
    """At least `min_chars` characters of templated sentences, one per line; a longer request extends a shorter one
    (same seed)."""
    rng = random.Random(seed)
    lines: list[str] = []
    length = 0
    while length < min_chars:
        lines.append(_sentence(rng))
        length += len(lines[-1]) + 1
    return "\n".join(lines)
