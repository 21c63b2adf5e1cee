import pytest

from kvtier.commands.batch import read_requests
from kvtier.errors import ConfigError


def test_reads_prompts_with_per_line_overrides(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hi"}\n\n{"prompt": "Bye", "max_new_tokens": 5, "priority": 2}\n')
    requests = read_requests(path, default_max_new_tokens=32)
    assert [prompt for prompt, _ in requests] == ["Hi", "Bye"]
    assert [(s.max_new_tokens, s.priority) for _, s in requests] == [(32, 0), (5, 2)]


@pytest.mark.parametrize("line, message", [
    ("not json", "prompts.jsonl:1: not JSON"),
    ('{"text": "Hi"}', 'prompts.jsonl:1: expected an object with a "prompt" string'),
    ('{"prompt": "Hi", "max_new_tokens": 0}', "prompts.jsonl:1: max_new_tokens must be a positive integer"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        read_requests(path, 8)


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        read_requests(path, 8)
