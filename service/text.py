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

    def pieces(self, ids: list[int]) -> list[str]: ...


_BYTE_PIECES = [bytes([i]).decode("utf-8", errors="replace") for i in range(256)]


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); ids above 255 (end-of-sequence and the like) have no text."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text, as decode([id]) gives it (a byte of a multi-byte character alone is U+FFFD)."""
        return [_BYTE_PIECES[i] if i < 256 else "" for i in ids]


class HFTokenizer:
    """A `tokenizers` tokenizer.json shipped in the artifact."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        # With the tokenizer's own special tokens, as transformers encodes by default: a Llama-family tokenizer.json
        # puts its BOS first (its post-processor), which the model was trained to see; GPT-2's adds nothing.
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)  # no "<|endoftext|>" in the text

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text, in one call into the tokenizers library (which releases the GIL for a batch): a
        Python call per id held the GIL for hundreds of milliseconds on a text at the size limit."""
        return self._tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)


def load_tokenizer(path: Path | None) -> Tokenizer:
    return HFTokenizer(path) if path is not None else ByteTokenizer()


class IncrementalDecoder:
    """Turns a token stream into text deltas that are always whole characters.

    Decoding tokens one by one breaks a character whose bytes span tokens, and decoding the whole
    sequence every step costs O(n) per token. So this decodes a short window: the text of the tokens
    since the last emitted boundary, and emits only the part past it, holding back while the window
    ends in an incomplete character (which decodes to U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] = ()):
        """context: the prompt's last few tokens. Decoded before the first new token, they keep its text as it reads
        after the prompt: a SentencePiece tokenizer drops a word's leading space when the word comes first."""
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context)
        self._prefix = 0  # start of the decode window (one emitted chunk of context for merges)
        self._read = len(self._ids)  # tokens up to here are already emitted (or are the prompt's)

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
    client never receives text that turns out to be (part of) a stop sequence.

    An Aho-Corasick automaton over the stops: each new character moves one state, so a push costs O(new
    text) whatever the number of stops, and the state's depth is exactly the longest tail of the text that
    begins some stop, which is what must be held back. The first stop to complete wins (among stops that
    complete at the same character, the longest), so the result does not depend on how text is chunked."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._next: list[dict[str, int]] = [{}]  # state -> character -> state (the trie)
        self._fail = [0]  # state -> the state of its longest proper suffix that is also in the trie
        self._depth = [0]  # state -> length of the text it stands for
        self._match: list[str | None] = [None]  # state -> the longest stop that ends here
        for stop in self._stops:
            state = 0
            for ch in stop:
                if ch not in self._next[state]:
                    self._next.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[state] + 1)
                    self._match.append(None)
                    self._next[state][ch] = len(self._next) - 1
                state = self._next[state][ch]
            self._match[state] = stop
        queue = list(self._next[0].values())
        for state in queue:  # breadth first: a state's fail link is settled before its children's
            for ch, child in self._next[state].items():
                self._fail[child] = self._step(self._fail[state], ch)
                if self._match[child] is None:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)
        self._state = 0
        self._held = ""

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)

    def push(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop sequence matched or None). After a match, stop."""
        if not self._stops:
            return delta, None
        text = self._held + delta
        for offset, ch in enumerate(delta):
            self._state = self._step(self._state, ch)
            stop = self._match[self._state]
            if stop is not None:
                end = len(self._held) + offset + 1
                self._state, self._held = 0, ""
                return text[: end - len(stop)], stop
        keep = self._depth[self._state]
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held
