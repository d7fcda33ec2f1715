import pytest

from tasks.core.errors import one_line, shown, UserInputError
from tasks.core.inputs import read_text
from tasks.core.limits import output_file


@pytest.mark.parametrize("text, expected", [
    ("/tmp/plain.csv", "/tmp/plain.csv"),
    ("/tmp/a\nb.csv", "/tmp/a\\nb.csv"),
    ("/tmp/a\rb\x1b[2J.csv", "/tmp/a\\rb\\x1b[2J.csv"),
    ("/tmp/\u0661\u0662.csv", "/tmp/\u0661\u0662.csv"),  # printable in its own script: kept
    ("/" + "a" * 4095, "/" + "a" * 119 + "... (4096 characters)"),
])
def test_user_text_in_an_error_line_is_escaped_and_shortened(text, expected):
    assert shown(text) == expected


@pytest.mark.parametrize("name", ["no\nsuch.json", "no\nsuch/\x1b[31mred.json", "/".join(["d" * 250] * 17)])
def test_errors_that_echo_a_path_stay_one_short_line(tmp_path, name):
    """Reading, writing under a file, and an OSError's own line: each names the path escaped and
    cut, never as many lines or 4 KB of it."""
    (tmp_path / "file").write_text("")
    with pytest.raises(UserInputError) as read_err:
        read_text(tmp_path / name, "profile")
    with pytest.raises(UserInputError) as write_err:
        output_file(str(tmp_path / "file" / name))
    oserror = FileNotFoundError(2, "No such file or directory", str(tmp_path / name))
    for message in (str(read_err.value), str(write_err.value), one_line(oserror)):
        assert "\n" not in message and "\x1b" not in message and len(message) < 400, message
