"""User-facing errors: the CLI prints str(error) on one line and exits non-zero."""


def setting(field: str) -> str:
    """How an error names a setting for both audiences: the field a Python caller sets (KVConfig's, or a keyword
    argument) and the command line's flag for it."""
    return f"{field} (--{field.replace('_', '-')})"


class KvtierError(Exception):
    """Base class for every error a user can cause (bad input, bad files, no space)."""


class ConfigError(KvtierError):
    """An option value that cannot work (unparsable size, budget too small, ...)."""


class ModelError(KvtierError):
    """Unknown model, failed install, hash mismatch, unreadable weights."""


class StorageError(KvtierError):
    """A storage file or directory that cannot be used (missing, unwritable, full, foreign)."""


class ChecksumError(StorageError):
    """Data read back from a storage file does not match the checksum written with it."""


class DamagedEntryError(StorageError):
    """A document KV store entry, or the tiers a cache stored with it, that fails a check or is cut short: the entry
    is damaged, never used."""


class ContextTooLongError(KvtierError):
    """Prompt plus requested new tokens exceed the model's context window."""
