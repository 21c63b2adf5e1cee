import os
import subprocess
import sys

from kvtier.processes import process_exists


def test_a_running_process_exists_and_a_reaped_one_does_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_exists(os.getpid())
    assert not process_exists(child.pid)
