"""Tool calls: a request's tools reach the prompt through the model's chat template (as transformers passes `tools`),
the reply's calls are generated under a grammar where the request needs them, and each sequence splits its reply into
content and calls, parsed as they stream.

A model family writes its calls in its own format, recognised from its chat template:
- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call,
  after any content;
- llama3_json (Llama 3.1 to 3.3): the whole reply is `{"name": ..., "parameters": {...}}`, calls joined by "; ";
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, call ids of 9 letters and digits (its template checks).

tool_choice `required` and a named function hold the reply to the calls grammar from its first token: each call's JSON
against its function's parameter schema (llguidance), so arguments always parse and validate. `auto` leaves the reply
free until it opens a call (the format's marker; for llama3_json, a reply whose first character is "{"), then holds the
rest to the grammar, as llama.cpp's lazy grammars do. `none` renders the tools and leaves the reply as text.
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

from .engine_errors import InvalidArgument
from .limits import EngineLimits
from .structured import FormatCompiler, FormatError, schema_depth

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}}
# A call's JSON spaced as templates write one with tojson (json.dumps' separators), so a model sees its own style.
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolChoice(enum.Enum):
    NONE = "none"  # tools rendered, the reply is text
    AUTO = "auto"  # text or calls, the model's choice
    REQUIRED = "required"  # one or more calls
    FUNCTION = "function"  # calls of the named function


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools as the engine takes them from either edge."""

    tools: str  # a JSON array of OpenAI tool entries: {"type": "function", "function": {"name", "description", "parameters"}}
    choice: ToolChoice = ToolChoice.AUTO
    function: str = ""  # with ToolChoice.FUNCTION: its name
    parallel: bool = True  # more than one call in a reply


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
        if finishing and not self.parser.complete_calls():  # no call came of it: the text is the reply's content
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


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict


class ToolCalling:
    """One served model's tool calling: its format (from its chat template), the calls grammar of a request's functions,
    and the per-sequence split."""

    def __init__(self, template: ChatTemplate | None, tokenizer: Tokenizer, formats: FormatCompiler, limits: EngineLimits):
        self.template, self.tokenizer, self.formats, self.limits = template, tokenizer, formats, limits
        self.format = call_format(template)
        self.rules = RULES.get(self.format)
        # Texts the vocabulary holds as one added token (Qwen's <tool_call> and </tool_call>, Mistral's [TOOL_CALLS]):
        # the grammar names them as tokens, since llguidance reads every added token as special, never as its bytes.
        self._added = tokenizer.added_tokens()
        self.marker_id = self._added.get(self.rules.marker) if self.rules is not None and self.rules.marker else None

    def read(self, request: ToolRequest) -> tuple[list[dict], list[Function]]:
        """The tools as the template reads them, and their functions; every fault named by its field."""
        limits = self.limits
        if self.template is None or not self.template.knows_tools:
            raise InvalidArgument("tools", "this model's chat template does not render tools (it never reads a `tools` variable)")
        if self.format is None:
            raise InvalidArgument("tools", "this model's chat template renders tools, but writes calls in a format kvserve does not "
                                  "read (known: hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS])")
        size = len(request.tools.encode("utf-8", errors="replace"))
        if size > limits.max_tools_bytes:
            raise InvalidArgument("tools", f"{size} bytes of JSON; at most {limits.max_tools_bytes}")
        try:
            tools = json.loads(request.tools)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument("tools", f"not JSON ({type(exc).__name__})") from None
        if not isinstance(tools, list) or not tools:
            raise InvalidArgument("tools", "must be a non-empty list of tools")
        if len(tools) > limits.max_tools:
            raise InvalidArgument("tools", f"{len(tools)} tools; at most {limits.max_tools}")
        functions, names = [], set()
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
                raise InvalidArgument(where, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
            if set(tool) - {"type", "function"}:
                raise InvalidArgument(f"{where}.{sorted(set(tool) - {'type', 'function'})[0]}", "is not a field of a tool")
            function = tool["function"]
            unknown = sorted(set(function) - FUNCTION_KEYS)
            if unknown:
                raise InvalidArgument(f"{where}.function.{unknown[0]}", "is not a field of a function")
            name = function.get("name")
            if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
                raise InvalidArgument(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes")
            if name in names:
                raise InvalidArgument(f"{where}.function.name", f"{name!r} is named twice")
            names.add(name)
            if not isinstance(function.get("description", ""), str):
                raise InvalidArgument(f"{where}.function.description", "must be a string")
            parameters = function.get("parameters", NO_PARAMETERS)
            if not isinstance(parameters, dict):
                raise InvalidArgument(f"{where}.function.parameters", "must be a JSON schema object")
            if schema_depth(parameters) > limits.max_schema_depth:
                raise InvalidArgument(f"{where}.function.parameters", f"nested {schema_depth(parameters)} deep; at most {limits.max_schema_depth}")
            functions.append(Function(name, parameters))
        if request.choice is ToolChoice.FUNCTION and request.function not in names:
            raise InvalidArgument("tool_choice", f"names the function {request.function!r}, which is not among the tools")
        return tools, functions

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """The calls grammar (llguidance's Lark) of functions in this model's format, its marker included."""
        call = {"type": "object", "properties": None, "required": ["name", self.rules.arguments_key], "additionalProperties": False}
        choices = [{**call, "properties": {"name": {"const": f.name}, self.rules.arguments_key: f.parameters}} for f in functions]
        one_call = choices[0] if len(choices) == 1 else {"anyOf": choices}
        marker = self._literal(self.rules.marker)
        if self.format is CallFormat.MISTRAL:
            calls = {"type": "array", "items": one_call, "minItems": 1, **({} if parallel else {"maxItems": 1}), "x-guidance": CALL_JSON_STYLE}
            return f"start: {marker} calls\ncalls: %json {json.dumps(calls)}\n"
        body = f"call_json: %json {json.dumps({**one_call, 'x-guidance': CALL_JSON_STYLE})}\n"
        if self.format is CallFormat.HERMES:
            more = f' ("\\n" call)*' if parallel else ""
            return f'start: call{more}\ncall: {marker} "\\n" call_json "\\n" {self._literal("</tool_call>")}\n' + body
        more = f" ({json.dumps(self.rules.separator)} call_json)*" if parallel else ""
        return f"start: call_json{more}\n" + body

    def _literal(self, text: str) -> str:
        """text in the grammar: the added token that is exactly text, or the text itself."""
        return f"<[{self._added[text]}]>" if text in self._added else json.dumps(text)

    def start(self, request: ToolRequest, functions: list[Function]):
        """(the sequence's split, the constraint it starts with): None for both under tool_choice none."""
        if request.choice is ToolChoice.NONE:
            return None, None
        if request.choice is ToolChoice.FUNCTION:
            functions = [f for f in functions if f.name == request.function]
        try:
            constraint = self.formats.compile_grammar(self.grammar(functions, request.parallel), "tools")
        except FormatError as exc:
            raise InvalidArgument("tools", exc.message) from None
        if request.choice is ToolChoice.AUTO:
            return ToolCallSplit(self.rules, self.marker_id, constraint, self.tokenizer, in_calls=False), None
        return ToolCallSplit(self.rules, self.marker_id, None, self.tokenizer, in_calls=True), constraint
