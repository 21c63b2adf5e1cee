"""Block keys chain the prefix: equal up to the first differing block, never equal across identities."""

from kvtier.docstore.keys import StoreIdentity, block_keys, block_tokens_for, document_key

IDENTITY = StoreIdentity("m@abc", "m@abc", "float32", "cpu")


def test_only_whole_blocks_are_keyed():
    assert len(block_keys(IDENTITY.digest(), list(range(1000)), 256)) == 3
    assert block_keys(IDENTITY.digest(), list(range(255)), 256) == []


def test_a_changed_token_changes_its_block_and_every_later_one():
    ids = list(range(1024))
    changed = ids.copy()
    changed[300] = 7
    mine, theirs = block_keys(IDENTITY.digest(), ids, 256), block_keys(IDENTITY.digest(), changed, 256)
    assert mine[0] == theirs[0] and all(a != b for a, b in zip(mine[1:], theirs[1:]))


def test_another_model_dtype_or_layout_never_shares_a_key():
    ids = list(range(512))
    others = [StoreIdentity("other@def", "other@def", "float32", "cpu"), StoreIdentity("m@abc", "m@abc", "bfloat16", "cpu"),
              StoreIdentity("m@abc", "m@abc", "float32", "cuda"), StoreIdentity("m@abc", "m@abc", "float32", "cpu", 128),
              StoreIdentity("m@abc", "m@abc", "float32", "cpu", format_version=99)]
    mine = set(block_keys(IDENTITY.digest(), ids, 256))
    for other in others:
        assert not mine & set(block_keys(other.digest(), ids, other.block_tokens))
    assert document_key(ids) == document_key(ids + [1, 2]) != document_key([9] + ids)


def test_blocks_are_the_fewest_tokens_whose_records_are_whole_pages():
    assert block_tokens_for(head_dim=64, item_bytes=4) == 16  # 4 KiB per head's K or V
    assert block_tokens_for(head_dim=64, item_bytes=2) == 32
    assert block_tokens_for(head_dim=256, item_bytes=4) == 16  # never below the floor
    assert block_tokens_for(head_dim=80, item_bytes=2) == 128  # 20 KiB: the first power of two that is whole pages
    assert block_tokens_for(head_dim=3, item_bytes=1) == 4096  # bounded: 4096 tokens are whole pages at any size
