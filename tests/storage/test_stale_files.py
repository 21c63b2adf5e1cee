import os
import subprocess
import sys

from kvtier.storage.stale_files import remove_abandoned_kv_files


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_kv_files_of_dead_processes_are_removed(tmp_path):
    pid = dead_pid()
    abandoned = [tmp_path / f"kv-{pid}-0123abcd.kvt", tmp_path / f"sparse-{pid}-0123abcd.sketch",
                 tmp_path / f"sparse-{pid}-0123abcd.kv", tmp_path / f"kv-{pid}-0123abcd.kvt.lock"]
    alive = tmp_path / f"kv-{os.getpid()}-0123abcd.kvt"
    unrelated = [tmp_path / f"notes-{pid}.txt", tmp_path / "bench-flash-64.kvc", tmp_path / f"kv-{pid}-xyz.kvt"]
    for path in [*abandoned, alive, *unrelated]:
        path.write_bytes(b"x")
    assert sorted(remove_abandoned_kv_files(tmp_path)) == sorted(abandoned)
    assert sorted(tmp_path.iterdir()) == sorted([alive, *unrelated])
