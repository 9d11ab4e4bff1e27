"""The default model's text: the King James Version of the Bible (1611, public domain; Debian's
`bible-kjv-text` package, read through its `bible` program from `bible-kjv`), split into chapters.

One chapter is one document: its verses, one per line, without their numbers. Every 20th chapter is held
out (never trained on, never seen by the tokenizer), so held-out text is the same kind of English as the
training text but none of it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from kvserve.errors import UserError

BIBLE_PROGRAM = "bible"  # Debian bible-kjv; its data file comes with bible-kjv-text
WHOLE_BIBLE = "gen1:1-rev22:21"
HELD_OUT_EVERY = 20  # chapter i is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
CHAPTER_HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")  # "Genesis 1", "1 Kings 3", "Song of Solomon 2"
VERSE = re.compile(r"^\s+\d+ (.*)$")


class CorpusUnavailable(UserError):
    """The text's package is not installed."""


@dataclass(frozen=True)
class Corpus:
    train: tuple[str, ...]  # chapters
    held_out: tuple[str, ...]


def read_chapters() -> list[str]:
    """Every chapter, in order, as text (verses joined by newlines)."""
    if shutil.which(BIBLE_PROGRAM) is None:
        raise CorpusUnavailable(
            "the King James text comes from Debian: apt-get install bible-kjv bible-kjv-text (make system-tools)"
        )
    # -l: one verse per line whatever the width (the program wraps at COLUMNS by default)
    output = subprocess.run([BIBLE_PROGRAM, "-l", "100000", WHOLE_BIBLE], capture_output=True, text=True, check=True).stdout
    chapters: list[list[str]] = []
    for line in output.splitlines():
        if CHAPTER_HEADING.match(line):
            chapters.append([])
        elif (verse := VERSE.match(line)) is not None:
            chapters[-1].append(verse.group(1).strip())
    return ["\n".join(verses) for verses in chapters]


def load_corpus() -> Corpus:
    chapters = read_chapters()
    held = {i for i in range(len(chapters)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
    return Corpus(
        train=tuple(c for i, c in enumerate(chapters) if i not in held),
        held_out=tuple(c for i, c in enumerate(chapters) if i in held),
    )
