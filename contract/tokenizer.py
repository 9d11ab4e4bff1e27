"""The artifact's tokenizer: tokenizer.json when the artifact ships one, else one token per UTF-8 byte (the tiny
presets). Read by the server (text in and out) and by export's held-out text check."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kvserve.errors import UserError


class TokenizerFileError(UserError):
    """A tokenizer.json the tokenizers library cannot read; the message names the file."""


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def pieces(self, ids: list[int]) -> list[str]: ...

    def added_tokens(self) -> dict[str, int]: ...


_BYTE_PIECES = [bytes([i]).decode("utf-8", errors="replace") for i in range(256)]


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); ids above 255 (end-of-sequence and the like) have no text."""

    name = "bytes"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens to add

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")  # ids past 255 have no text either way

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text, as decode([id]) gives it (a byte of a multi-byte character alone is U+FFFD)."""
        return [_BYTE_PIECES[i] if i < 256 else "" for i in ids]

    def added_tokens(self) -> dict[str, int]:
        return {}


class HFTokenizer:
    """A `tokenizers` tokenizer.json shipped in the artifact."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the library's errors name no file
            raise TokenizerFileError(f"{path}: not a tokenizer.json the tokenizers library reads ({exc})") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # With the tokenizer's own special tokens, as transformers encodes by default: a Llama-family tokenizer.json
        # puts its BOS first (its post-processor), which the model was trained to see; GPT-2's adds nothing. A rendered
        # chat template writes its own (contract/chat.py), so it is encoded without them.
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # by default no "<|endoftext|>" in the text

    def to_json(self) -> str:
        """The tokenizer.json text (structured output builds its grammar tokenizer from it)."""
        return self._tokenizer.to_str()

    def added_tokens(self) -> dict[str, int]:
        """The tokens added to the vocabulary whole (special or not: Qwen's <tool_call> is not), by their text."""
        return {token.content: id_ for id_, token in self._tokenizer.get_added_tokens_decoder().items()}

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text, in one call into the tokenizers library (which releases the GIL for a batch): a
        Python call per id held the GIL for hundreds of milliseconds on a text at the size limit."""
        return self._tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)


def load_tokenizer(path: Path | None) -> Tokenizer:
    return HFTokenizer(path) if path is not None else ByteTokenizer()
