"""Text: the Unicode a client's JSON text must hold (no lone surrogate), and out, the streaming rules that keep every
text delta valid UTF-8 and keep stop sequences out of the stream (the tokenizers themselves are the artifact's:
contract/tokenizer.py)."""

from __future__ import annotations

from kvserve.contract.tokenizer import Tokenizer

from .engine_errors import InvalidArgument

REPLACEMENT = "\ufffd"


def encodable(text: str) -> bool:
    """Whether text is valid Unicode: no lone surrogate (JSON's \\ud800 escapes and CESU-8 bytes spell them; no
    tokenizer or response encodes them)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def refuse_lone_surrogates(value, where: str) -> None:
    """InvalidArgument naming the first key or string of a parsed JSON value (named where) that holds a lone surrogate
    (a JSON escape spells one inside valid text); walked without recursion."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not encodable(item):
                raise InvalidArgument(path, "is not valid Unicode (a lone surrogate)")
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and not encodable(key):
                    raise InvalidArgument(f"a key under {path}", "is not valid Unicode (a lone surrogate)")
                stack.append((inner, f"{path}.{key}" if len(str(key)) <= 40 else f"{path}.<key>"))
        elif isinstance(item, list):
            stack.extend((inner, f"{path}[{index}]") for index, inner in enumerate(item))


class IncrementalDecoder:
    """Turns a token stream into text deltas that are always whole characters.

    Decoding tokens one by one breaks a character whose bytes span tokens, and decoding the whole
    sequence every step costs O(n) per token. So this decodes a short window: the text of the tokens
    since the last emitted boundary, and emits only the part past it, holding back while the window
    ends in an incomplete character (which decodes to U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] = (), skip_special_tokens: bool = True):
        """context: the prompt's last few tokens. Decoded before the first new token, they keep its text as it reads
        after the prompt: a SentencePiece tokenizer drops a word's leading space when the word comes first.
        skip_special_tokens: leave special tokens' text out (the default), or write it."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context)
        self._prefix = 0  # start of the decode window (one emitted chunk of context for merges)
        self._read = len(self._ids)  # tokens up to here are already emitted (or are the prompt's)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is held back (an incomplete character becomes U+FFFD)."""
        before = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopSequences:
    """Finds stop sequences in streamed text, holding back any tail that could be the start of one, so a
    client never receives text that turns out to be (part of) a stop sequence.

    An Aho-Corasick automaton over the stops: each new character moves one state, so a push costs O(new
    text) whatever the number of stops, and the state's depth is exactly the longest tail of the text that
    begins some stop, which is what must be held back. The first stop to complete wins (among stops that
    complete at the same character, the longest), so the result does not depend on how text is chunked."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        """include_stop: the matched stop ends the text emitted (else it is left out)."""
        self._include = include_stop
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
                return text[: end if self._include else end - len(stop)], stop
        keep = self._depth[self._state]
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held
