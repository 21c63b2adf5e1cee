from kvtier.eval.serving.serve_bench import allocator_replay, disk_sequential_bandwidth


def test_replay_shows_the_log_appends_sequentially_and_naive_reuse_does_not():
    replay = allocator_replay(swap_outs=300, slots=256)
    assert replay["FlashLog"]["sequential_share"] == 1.0
    assert replay["NaiveReuseAllocator"]["sequential_share"] < 0.9
    assert replay["FlashLog"]["appends"] == replay["NaiveReuseAllocator"]["appends"] == 300


def test_disk_bandwidth_moves_the_requested_bytes_and_cleans_up(tmp_path):
    result = disk_sequential_bandwidth(tmp_path, 4 << 20, threads=2, run_bytes=1 << 20)
    assert result["disk_test_bytes"] == 4 << 20
    assert result["disk_sequential_write"] > 0 and result["disk_sequential_read"] > 0
    assert list(tmp_path.iterdir()) == []
