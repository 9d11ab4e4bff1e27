"""Long commands show their stages, elapsed times and progress on a terminal, and nothing anywhere else."""

import io

from kvserve.progress import progress, stage


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stages_and_a_progress_bar_are_drawn_on_a_terminal():
    out = Terminal()
    with stage("verify parity", out=out):
        items = list(progress(range(4), 4, "windows", out=out))
    assert items == [0, 1, 2, 3]
    text = out.getvalue()
    assert text.startswith("== verify parity ...\n")
    assert "\r   windows [" + "#" * 30 + "] 4/4, " in text
    assert "   verify parity: " in text and " s (total " in text


def test_nothing_is_written_when_the_output_is_not_a_terminal():
    out = io.StringIO()
    with stage("verify parity", out=out):
        assert list(progress(iter("abc"), 3, "windows", out=out)) == ["a", "b", "c"]
    assert out.getvalue() == ""
