"""Text in and out: tokenizers, and the streaming rules that keep every text delta valid UTF-8 and keep
stop sequences out of the stream."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); ids above 255 (end-of-sequence and the like) have no text."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json shipped in the artifact."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)  # no "<|endoftext|>" in the text


def load_tokenizer(path: Path | None) -> Tokenizer:
    return HFTokenizer(path) if path is not None else ByteTokenizer()


class IncrementalDecoder:
    """Turns a token stream into text deltas that are always whole characters.

    Decoding tokens one by one breaks a character whose bytes span tokens, and decoding the whole
    sequence every step costs O(n) per token. So this decodes a short window: the text of the tokens
    since the last emitted boundary, and emits only the part past it, holding back while the window
    ends in an incomplete character (which decodes to U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (one emitted chunk of context for merges)
        self._read = 0  # tokens up to here are already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is held back (an incomplete character becomes U+FFFD)."""
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopSequences:
    """Finds stop sequences in streamed text, holding back any tail that could be the start of one, so a
    client never receives text that turns out to be (part of) a stop sequence."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop sequence matched or None). After a match, stop."""
        if not self._stops:
            return delta, None
        text = self._held + delta
        hits = [(text.find(s), s) for s in self._stops if s in text]
        if hits:
            index, stop = min(hits)
            self._held = ""
            return text[:index], stop
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
