"""HiFC swap path: many sequences under continuous batching, KV blocks swapped to a flash cache file."""
