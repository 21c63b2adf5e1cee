"""The cache layer every KV mode builds on: the cache contract, `--kv dense` and `--kv offload`, byte budgets,
token gathers and the model -> KVGeometry helper. Imports storage only, never a mode above it."""
