"""A reply's tool calls as text: how each model family writes them (its format, recognised from its chat template), a
sequence's reply split into content and call text as it streams (opening the calls' constraint where the reply opens
them), and the parser that reads calls out of call text, a name and then pieces of arguments at a time.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from dataclasses import dataclass

from kvserve.contract.chat import ChatTemplate, ToolCall
from kvserve.contract.tokenizer import Tokenizer

from .structured import FormatError


class CallFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


@dataclass(frozen=True)
class FormatRules:
    marker: str  # the text that opens the calls ("": a reply that starts with "{")
    arguments_key: str
    separator: str  # between two calls
    ids: str  # how call ids look: "openai" (call_ + 24 characters) or "mistral" (9 letters and digits)


RULES = {
    CallFormat.HERMES: FormatRules("<tool_call>", "arguments", "\n", "openai"),
    CallFormat.LLAMA3_JSON: FormatRules("", "parameters", "; ", "openai"),
    CallFormat.MISTRAL: FormatRules("[TOOL_CALLS]", "arguments", ", ", "mistral"),
}


def call_format(template: ChatTemplate | None) -> CallFormat | None:
    """The call format a chat template teaches; None for a template that renders no tools or no format known here."""
    if template is None or not template.knows_tools:
        return None
    if "<tool_call>" in template.source:
        return CallFormat.HERMES
    if "[TOOL_CALLS]" in template.source:
        return CallFormat.MISTRAL
    if "ipython" in template.source or "<|python_tag|>" in template.source:
        return CallFormat.LLAMA3_JSON
    return None


def new_call_id(style: str) -> str:
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


@dataclass(frozen=True)
class CallDelta:
    """A piece of one call as it streams: the first names it (id, name), later ones extend its arguments' text."""

    index: int  # which call of the reply
    arguments: str = ""
    id: str | None = None
    name: str | None = None


CALL_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class CallParser:
    """Reads calls out of a reply's call text as it grows: each call's header (its name) once complete, then its
    arguments (a JSON object) as they arrive. Markers, separators and brackets between calls are skipped, so one parser
    reads every format; a special-token marker that decodes to no text changes nothing."""

    def __init__(self, id_style: str):
        self.id_style = id_style
        self.text = ""
        self.calls: list[ToolCall] = []  # complete ones
        self._scan = 0  # where reading resumes
        self._open: tuple[str, str, int] | None = None  # the call being read: (id, name, where its arguments start)
        self._depth, self._in_string, self._escaped, self._sent = 0, False, False, 0

    def push(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas = []
        while True:
            if self._open is None:
                header = CALL_HEADER.search(self.text, self._scan)
                if header is None:
                    return deltas
                try:
                    name = json.loads(f'"{header.group(1)}"')
                except ValueError:
                    name = header.group(1)
                self._open = (new_call_id(self.id_style), name, header.end())
                self._scan = self._sent = header.end()
                self._depth, self._in_string, self._escaped = 0, False, False
                deltas.append(CallDelta(len(self.calls), id=self._open[0], name=name))
            if self._depth == 0 and not self._in_string:  # the arguments begin at their first non-blank character
                start = self._open[2]
                while start < len(self.text) and self.text[start].isspace():
                    start += 1
                self._open, self._scan, self._sent = (*self._open[:2], start), start, max(self._sent, start)
            end = self._arguments_end()
            if end is None:
                if len(self.text) > self._sent:
                    deltas.append(CallDelta(len(self.calls), arguments=self.text[self._sent:]))
                    self._sent = len(self.text)
                return deltas
            call_id, name, start = self._open
            if end > self._sent:
                deltas.append(CallDelta(len(self.calls), arguments=self.text[self._sent:end]))
            self.calls.append(ToolCall(call_id, name, self.text[start:end]))
            self._open, self._scan = None, end

    def _arguments_end(self) -> int | None:
        """Where the open call's arguments end (past their closing brace), or None while they go on."""
        for position in range(self._scan, len(self.text)):
            ch = self.text[position]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scan = position + 1
                    return position + 1
        self._scan = len(self.text)
        return None

    def complete_calls(self) -> tuple[ToolCall, ...]:
        """The calls read whole whose arguments are a JSON object."""
        out = []
        for call in self.calls:
            try:
                if isinstance(json.loads(call.arguments), dict):
                    out.append(call)
            except ValueError:
                pass
        return tuple(out)


class ToolCallSplit:
    """One sequence's reply split into content and call text. A reply that opens a call (or is held to calls from its
    start) gets its constraint then; content that may be the start of a marker is held back until it is not."""

    def __init__(self, rules: FormatRules, marker_id: int | None, start_constraint, tokenizer: Tokenizer, in_calls: bool):
        """start_constraint: a fresh Constraint of the calls grammar (auto; None where the reply is held from its start)."""
        self.rules, self.marker_id, self._start_constraint, self._tokenizer = rules, marker_id, start_constraint, tokenizer
        self.in_calls = in_calls
        self.parser = CallParser(rules.ids)
        self._held = ""
        self._content_seen = False  # non-blank content came first: llama3_json then writes no call
        self.calls: tuple[ToolCall, ...] = ()  # once the reply ends: its whole calls

    def split(self, sequence, token: int, text: str, finishing: bool) -> tuple[str, str, list[CallDelta]]:
        """(content, call text, call deltas) of a step's text; opens the calls (and their constraint) when the reply does."""
        if not self.in_calls:
            text, call_text = self._find_opening(sequence, token, self._held + text)
            if not self.in_calls:
                if finishing:
                    text, self._held = text + self._held, ""
                return text, "", []
        else:
            text, call_text = "", text
        deltas = self.parser.push(call_text) if call_text else []
        if finishing:
            self.calls = self.parser.complete_calls()
            if not self.calls:  # no call came of it: the text is the reply's content
                return text + self.parser.text, "", []
        return text, call_text, deltas

    def _find_opening(self, sequence, token: int, pending: str) -> tuple[str, str]:
        """(content, call text): the calls open at a marker token, a marker in the text, or (llama3_json) a reply starting
        with "{"; a tail that may begin a marker is held back."""
        marker = self.rules.marker
        if self.marker_id is not None and token == self.marker_id:  # its text, if it decodes to any, ends pending
            self._held = ""
            at = pending.rfind(marker) if marker else -1
            return self._open(sequence, pending if at < 0 else pending[:at], "" if at < 0 else pending[at:], [self.marker_id])
        if not marker:
            if self._content_seen:
                return pending, ""
            stripped = pending.lstrip()
            if not stripped:
                self._held = pending
                return "", ""
            self._held = ""
            if stripped.startswith("{"):
                return self._open(sequence, pending[: len(pending) - len(stripped)], stripped, None)
            self._content_seen = True
            return pending, ""
        at = pending.find(marker)
        if at >= 0:
            self._held = ""
            return self._open(sequence, pending[:at], pending[at:], None)
        keep = next((k for k in range(min(len(marker) - 1, len(pending)), 0, -1) if marker.startswith(pending[-k:])), 0)
        self._held = pending[len(pending) - keep:]
        return pending[: len(pending) - keep], ""

    def _open(self, sequence, content: str, call_text: str, tokens: list[int] | None) -> tuple[str, str]:
        """The reply has opened its calls: the rest is held to the calls grammar, fed what the call text already holds."""
        self.in_calls = True
        constraint = self._start_constraint
        try:
            for token in tokens if tokens is not None else self._tokenizer.encode(call_text, add_special_tokens=False):
                constraint.accept(token)
            sequence.constraint = constraint
        except FormatError:  # the opening does not read as the grammar's: left free, and parsed as far as it goes
            pass
        return content, call_text
