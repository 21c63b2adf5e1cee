"""Remove KV files left in a storage dir by runs that were killed before they could delete them.

Every KV file a run creates is named `<kind>-<pid>-<8 hex>.<ext>` (offload `kv-*.kvt`,
baselines `<store>-*.kvt`, sparse `sparse-*.kv` / `.sketch` / `.aside`) and deleted when the cache
closes; only a killed process (SIGKILL, OOM) leaves one behind, and hundreds of MiB each
add up. A file whose pid no longer exists on this machine is abandoned, and so is its
lock file (`<name>.lock`, file_lock.py).
"""

import logging
import re
from pathlib import Path

from kvtier.processes import process_exists

log = logging.getLogger(__name__)
RUN_FILE = re.compile(r"^[a-z_]+-(\d+)-[0-9a-f]{8}\.(kvt|kv|sketch|aside)(\.lock)?$")


def remove_abandoned_kv_files(directory: Path) -> list[Path]:
    """Delete KV files in `directory` whose writer process is gone; return what was removed."""
    removed = []
    for path in directory.iterdir():
        match = RUN_FILE.match(path.name)
        if match and path.is_file() and not process_exists(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d KV file(s) of killed runs from %s", len(removed), directory)
    return removed
