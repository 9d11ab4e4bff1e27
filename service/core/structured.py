"""Structured output: a request's response_format (a JSON schema, any JSON object, a regular expression or a Lark
grammar) becomes a per-sequence grammar state that says, before every token, which tokens may come next.

llguidance computes the masks (docs/serving.md, "Structured output", says why it and not outlines-core: compile
time, grammars, and bounded work per step). Its tokenizer is built once per server from the artifact's own
(tokenizer.json, or one token per byte) and covers the model's whole vocabulary: ids the tokenizer lacks are
never allowed.

Costs a client controls are bounded: the format's size (EngineLimits.max_response_format_bytes), a JSON schema's
nesting (EngineLimits.max_schema_depth), and llguidance's fuel and state limits (PARSER_LIMITS), which bound both the work at
admission (the grammar is built and its first mask computed before the request is admitted, off the event loop)
and each later step's mask. A format that breaks a limit is refused by name; one whose lexer outgrows its limits
only later fails its own sequence then, never another's. Compiled formats are cached per server
(COMPILED_CACHE_SIZE, least recently used out): each sequence runs a copy of its format's compiled state.

Masks for a step's constrained rows are computed on a thread of their own (TokenMasks), started before the model
step and read after it: llguidance releases the GIL, so they overlap the step instead of following it.
"""

from __future__ import annotations

import enum
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from kvserve.contract.tokenizer import HFTokenizer, Tokenizer

from .limits import EngineLimits

COMPILED_CACHE_SIZE = 64  # compiled formats a server keeps
# llguidance's limits, lowered from its defaults where a default let one request take seconds or hundreds of MB:
# a{1000}{1000} took 0.8 s for its first mask at the default initial fuel (1,000,000), 36 ms at 100,000; 250,000
# lexer states at 1-2 kB each is up to 500 MB a sequence, 20,000 is 40 MB. A step's mask is held to ~50,000 fuel
# (a few ms).
PARSER_LIMITS = dict(initial_lexer_fuel=100_000, step_lexer_fuel=50_000, max_lexer_states=20_000, max_grammar_size=200_000)
# JSON without free whitespace between tokens: a small model given the choice fills the output with whitespace (and
# newlines) until its token budget runs out, and the output never closes.
JSON_OPTIONS = {"whitespace_flexible": False}


class FormatKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    GRAMMAR = "grammar"  # llguidance's Lark syntax


@dataclass(frozen=True)
class ResponseFormat:
    kind: FormatKind
    text: str = ""  # the schema (JSON text), the pattern or the grammar; empty for JSON_OBJECT


class FormatError(Exception):
    """A response_format that cannot be compiled, breaks a limit, or failed during generation: the request's fault.
    field: the request field it names (response_format, or the part of it)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


class Constraint:
    """One sequence's grammar state. The step's mask thread computes its masks; the step thread feeds it the tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, field_name: str = "response_format"):
        self.matcher = matcher
        self.field = field_name  # what a failure names: the request's response_format, or its tools

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise FormatError(self.field, f"failed during generation: {self.matcher.get_error().splitlines()[0]}")

    @property
    def finished(self) -> bool:
        """Whether the structure is complete and nothing may follow it."""
        return self.matcher.is_stopped()

    def check(self) -> None:
        if self.matcher.is_error():
            raise FormatError(self.field, f"failed during generation: {self.matcher.get_error().splitlines()[0]}")


def schema_depth(value) -> int:
    """Nesting of arrays and objects in a parsed JSON document, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


class _ByteVocabulary:
    """The byte tokenizer (contract/tokenizer.ByteTokenizer) as llguidance.TokenizerWrapper reads a tokenizer: ids
    0-255 are bytes, every id above is special (end-of-sequence and the like)."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...]):
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class FormatCompiler:
    """Turns response formats into Constraints for one model's tokenizer; caches the compiled ones. Thread-safe:
    requests are checked on worker threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...], max_format_bytes: int,
                 max_schema_depth: int = EngineLimits.max_schema_depth):
        self._source, self.vocab_size, self.eos_ids, self.max_format_bytes = tokenizer, vocab_size, eos_ids, max_format_bytes
        self.max_schema_depth = max_schema_depth  # nested arrays and objects in a JSON schema document
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~0.2 s for GPT-2's 50,257 tokens
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)
        self._compiled: OrderedDict[object, llguidance.LLMatcher] = OrderedDict()  # by ResponseFormat, or (field, grammar)
        self._lock = threading.Lock()
        self.compiles = self.cache_hits = 0

    def _grammar_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                eos = list(self.eos_ids) or None
                if isinstance(self._source, HFTokenizer):
                    self._tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self.vocab_size, eos_token=eos)
                else:
                    wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(self.vocab_size, self.eos_ids))
                    self._tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def grammar(self, fmt: ResponseFormat) -> str:
        """fmt in llguidance's grammar form, after the checks that need no tokenizer."""
        size = len(fmt.text.encode("utf-8", errors="replace"))
        if size > self.max_format_bytes:
            raise FormatError("response_format", f"{size} bytes; at most {self.max_format_bytes}")
        if fmt.kind is FormatKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if fmt.kind is FormatKind.JSON_SCHEMA:
            try:
                schema = json.loads(fmt.text)
            except (ValueError, RecursionError) as exc:
                raise FormatError("response_format.json_schema", f"not JSON ({str(exc)[:200]})") from None
            if schema is False:
                raise FormatError("response_format.json_schema", "false: no output satisfies it")
            if schema is True:
                schema = {}  # any JSON value
            if not isinstance(schema, dict):
                raise FormatError("response_format.json_schema", "a schema is a JSON object (or true/false)")
            depth = schema_depth(schema)
            if depth > self.max_schema_depth:
                raise FormatError("response_format.json_schema", f"nested {depth} deep; at most {self.max_schema_depth}")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise FormatError("response_format.json_schema", str(exc)) from None
        if not fmt.text:
            raise FormatError(f"response_format.{fmt.kind.value}", "empty")
        if fmt.kind is FormatKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(fmt.text)
        return llguidance.LLMatcher.grammar_from_lark(fmt.text)

    def compile(self, fmt: ResponseFormat) -> Constraint:
        """A fresh Constraint for fmt, at its start; FormatError names what is wrong with fmt."""
        return self._compile(fmt, lambda: self.grammar(fmt), f"response_format.{fmt.kind.value}")

    def compile_grammar(self, lark: str, field_name: str) -> Constraint:
        """A fresh Constraint for a grammar the server wrote (a request's tool calls: tool_calls.py), whose size the
        request's own limits bound; failures name field_name."""
        return self._compile((field_name, lark), lambda: lark, field_name)  # cached apart from clients' own grammars

    def _compile(self, key, grammar_of, field_name: str) -> Constraint:
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.cache_hits += 1
        if compiled is None:
            grammar = grammar_of()
            tokenizer = self._grammar_tokenizer()
            compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)  # releases the GIL
            # The first mask builds the lexer's start: a pattern that explodes does so here, before admission.
            mask = np.zeros(((self.vocab_size + 31) // 32,), dtype=np.int32)
            if not compiled.is_error():
                compiled.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if compiled.is_error():
                raise FormatError(field_name, compiled.get_error().splitlines()[0])
            if not mask.any():
                raise FormatError(field_name, "no output satisfies it")
            with self._lock:
                self.compiles += 1
                self._compiled[key] = compiled
                while len(self._compiled) > COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return Constraint(compiled.deep_copy(), field_name.split(".")[0])


class TokenMasks:
    """Computes the allowed tokens of a step's constrained rows on a thread of its own, while the model step runs."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-masks")
        self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 1) // 2)))

    def start(self, constrained, drafts: dict | None = None) -> Future:
        """Masks for constrained (sequences with a .constraint): a future of {sequence: the ids it may take next,
        ascending}; for a sequence with drafts ({sequence: token ids}, each valid in turn: drafts.py), a list of them,
        one for its next position and one after each of its drafts."""
        return self._thread.submit(self._compute, constrained, drafts or {})

    def _compute(self, constrained, drafts: dict) -> dict:
        bits = np.zeros((len(constrained), self._words), dtype=np.int32)  # (K, ceil(V / 32)), bit i of word j: id 32j + i
        fill_next_token_bitmask_par(self._executor, [(s.constraint.matcher, i) for i, s in enumerate(constrained)], bits)
        masks = {seq: np.flatnonzero(row) for seq, row in zip(constrained, self._unpack(bits))}
        for seq, tokens in drafts.items():
            if seq in masks:
                masks[seq] = [masks[seq]] + self._after_each(seq.constraint.matcher, tokens)
        return masks

    def _after_each(self, matcher: llguidance.LLMatcher, tokens: list[int]) -> list[np.ndarray]:
        """The allowed ids after each of tokens is taken in turn; the matcher is left as it was (rolled back)."""
        after = []
        for token in tokens:
            if not matcher.consume_token(token):  # validated when drafted (scheduler.py), so never; else no more masks
                break
            after.append(np.flatnonzero(self._unpack(np.frombuffer(matcher.compute_bitmask(), np.int32)[None])[0]))
            if matcher.is_stopped():  # the structure is complete: a row taking this draft ends with it
                break
        matcher.rollback(len(after))
        return after

    def _unpack(self, bits: np.ndarray) -> np.ndarray:
        """(K, ceil(V / 32)) int32 bit rows -> (K, V) 0/1."""
        return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]

    def close(self) -> None:
        self._thread.shutdown(wait=True)
