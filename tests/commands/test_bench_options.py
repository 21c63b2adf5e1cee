import argparse

import pytest

from kvtier.commands.bench_options import add_flash_dir_option, flash_dir_from
from kvtier.errors import StorageError


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_flash_dir_option(parser)
    return parser.parse_args(list(argv))


def test_a_missing_flash_dir_is_created(tmp_path):
    target = tmp_path / "a" / "flash"
    assert flash_dir_from(_args("--flash-dir", str(target))) == target and target.is_dir()


def test_a_flash_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StorageError, match=r"flash directory .*file: .*; pass another --flash-dir"):
        flash_dir_from(_args("--flash-dir", str(tmp_path / "file")))
