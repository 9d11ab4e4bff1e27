"""Long commands show their stages, elapsed times and progress on a terminal, and one line a finished stage anywhere else."""

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


def test_a_log_gets_one_line_a_finished_stage_and_no_progress_bar():
    out = io.StringIO()
    with stage("verify parity", out=out):
        assert list(progress(iter("abc"), 3, "windows", out=out)) == ["a", "b", "c"]
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("== verify parity: ") and " s (total " in lines[0]
    try:
        with stage("export", out=out):
            raise ValueError("refused")
    except ValueError:
        pass
    assert out.getvalue().count("\n") == 1  # a stage that fails says nothing: the error is the one line
