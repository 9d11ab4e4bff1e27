"""What a long command is doing: on a terminal, each stage as it starts and how long it took, and a progress bar for
a loop that runs long; elsewhere (a log, a pipe, CI), one line a stage as it ends, so a silent minute still says what
ran. Written to stderr."""

from __future__ import annotations

import contextlib
import sys
import time

_started = time.perf_counter()


def _terminal(out) -> bool:
    return hasattr(out, "isatty") and out.isatty()


@contextlib.contextmanager
def stage(name: str, out=None):
    """`with stage("verify parity"):` prints the stage, then its elapsed time and the command's so far."""
    out = sys.stderr if out is None else out
    terminal = _terminal(out)
    start = time.perf_counter()
    if terminal:
        out.write(f"== {name} ...\n")
        out.flush()
    yield
    now = time.perf_counter()
    out.write(f"{'   ' if terminal else '== '}{name}: {now - start:.1f} s (total {now - _started:.1f} s)\n")
    out.flush()


def progress(items, total: int, label: str, out=None, width: int = 30):
    """Yield items, drawing `label [#####.....] i/total, elapsed` on one terminal line as they go."""
    out = sys.stderr if out is None else out
    if not _terminal(out):
        yield from items
        return
    start = time.perf_counter()
    for done, item in enumerate(items, 1):
        yield item
        filled = width * done // max(total, 1)
        out.write(f"\r   {label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}, {time.perf_counter() - start:.1f} s")
        out.flush()
    out.write("\n")
    out.flush()
