"""The document KV store: a prompt's prefill KV kept on flash, reused by later prompts that start with it.

Chat with a long document asks one document many questions; each question's
prompt starts with the same tokens, whose K/V are the same (attention is
causal). After a prefill, the prompt's whole blocks (16 tokens, or the fewest that make a record whole pages:
keys.block_tokens_for) are
published as one entry; a later run, in any process, whose prompt starts with
a stored prefix reads those blocks back (O_DIRECT, every record's crc32c
verified), feeds them to its cache as a prefill would, and runs only the rest
of the prompt through the model. Every KV mode prefills densely, so one entry
serves dense, offload and sparse alike. A `--kv sparse` run that publishes also
stores its placed tiers in the entry (`sparse/`, written by kvtier.sparse.cold.cold_image
before the rename that publishes the entry); a later sparse run uses that cold
pool in place instead of placing the prefix again; a `--kv offload` run reads
the prefix it would spill from the entry's kv.bin in place instead of writing
it to its own KV file (entry.StoredKV). The store treats the
directory as part of the entry (size, removal) and knows nothing of its format.

    keys.py            what an entry is keyed on: the bytes' identity, the tokens chained per block
    meta.py            an entry's meta.json: identity, block keys, layer shapes, record checksums
    entry.py           an entry's kv.bin: one run per (layer, K|V, head), written in place, read straight into tensors
    document_store.py  DocumentStore: longest-prefix lookup, publish, LRU bound, list / remove / clear, stale files
    reuse.py           one prompt's use of the store: what to load, what to record, when to publish
    recovery.py        a prompt into a fresh cache with the store; a damaged entry dropped (or raised), then cold
"""

from kvtier.docstore.document_store import DocumentStore, default_store_dir

__all__ = ["DocumentStore", "default_store_dir"]
