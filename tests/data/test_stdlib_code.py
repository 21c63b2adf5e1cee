"""kvtier.data.stdlib_code: Python sources read from a directory (the interpreter's standard library by default)."""

import ast

from kvtier.data.stdlib_code import stdlib_code, stdlib_directory


def test_the_standard_library_gives_parseable_python_in_sorted_file_order():
    text = stdlib_code(40_000)
    assert len(text) >= 40_000
    names = [line.removeprefix("# file: ") for line in text.splitlines() if line.startswith("# file: ")]
    assert names == sorted(names) and all(name.endswith(".py") for name in names)
    first = text.split("# file: ")[1]  # one whole module: its text is Python
    ast.parse(first.split("\n", 1)[1])
    assert stdlib_directory().joinpath(names[0]).is_file()


def test_a_longer_request_extends_a_shorter_one(tmp_path):
    for index in range(5):
        (tmp_path / f"m{index}.py").write_text(f"x{index} = {index}\n" * 50)
    (tmp_path / "notes.txt").write_text("not code")
    short = stdlib_code(100, tmp_path)
    assert stdlib_code(2_000, tmp_path).startswith(short) and short.startswith("# file: m0.py\nx0 = 0")
    assert "not code" not in stdlib_code(10**6, tmp_path)  # only .py files, all of them when fewer than asked
    assert stdlib_code(10**6, tmp_path).count("# file: ") == 5


def test_a_module_that_is_not_utf8_is_skipped(tmp_path):
    (tmp_path / "a.py").write_bytes(b"\xff\xfe broken")
    (tmp_path / "b.py").write_text("y = 1\n")
    assert stdlib_code(10, tmp_path) == "# file: b.py\ny = 1\n"
