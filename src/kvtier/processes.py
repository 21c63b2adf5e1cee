"""Whether a process id is alive: files named after their writer's pid are abandoned once it is gone."""

import os


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
