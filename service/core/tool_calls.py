"""Tool calls: a request's tools reach the prompt through the model's chat template (as transformers passes `tools`),
the reply's calls are generated under a grammar where the request needs them, and each sequence splits its reply into
content and calls, parsed as they stream.

A model family writes its calls in its own format, recognised from its chat template (tool_call_text.py holds the
formats, the per-sequence split of a reply into content and calls, and the parser):
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
from dataclasses import dataclass

from kvserve.contract.chat import ChatTemplate
from kvserve.contract.tokenizer import Tokenizer

from .engine_errors import InvalidArgument
from .limits import EngineLimits
from .structured import FormatCompiler, FormatError, schema_depth
from .text import refuse_lone_surrogates
from .tool_call_text import RULES, CallFormat, ToolCallSplit, call_format

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


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict  # its local references rebased under $defs/<key> (_rebased)
    index: int = 0  # its place among the request's functions

    @staticmethod
    def key_of(index: int) -> str:
        return f"kvserve_function_{index}"

    @property
    def key(self) -> str:
        return self.key_of(self.index)


# Keywords whose values are data, not schemas: a "$ref" inside them is a value to match, not a reference.
DATA_KEYWORDS = {"const", "enum", "default", "examples"}
# Keywords whose values map names (any names, "enum" or "$ref" among them) to schemas.
NAMED_SCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _rebased(parameters: dict, where: str, index: int) -> dict:
    """A function's parameters as they sit in the calls grammar, under $defs/<key>: each local reference ("#", "#/...")
    rewritten to point into them there, so "#/$defs/X" and "#/properties/name" mean what they meant in the client's
    document; a reference to another document is refused (nothing is fetched)."""
    base = f"#/$defs/{Function.key_of(index)}"

    def walk(node, path: str, names: bool = False):
        if isinstance(node, list):
            return [walk(item, f"{path}[{i}]") for i, item in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if names or key in NAMED_SCHEMAS:
                inner = f"{path}.{key}" if len(key) <= 40 else f"{path}.<key>"
                out[key] = walk(value, inner, names=not names)
            elif key == "$ref" and isinstance(value, str):
                if not value.startswith("#"):
                    raise InvalidArgument(f"{path}.$ref", f"{value[:40]!r} is not a local reference (#/...): other documents are never fetched")
                out[key] = base + value[1:]
            elif key in DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = walk(value, f"{path}.{key}" if len(key) <= 40 else f"{path}.<key>")
        return out

    return walk(parameters, where)  # depth already bounded (schema_depth)


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
        try:  # (its size was held to max_tools_bytes with the request's other sizes: validation.check_sizes)
            tools = json.loads(request.tools)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument("tools", f"not JSON ({type(exc).__name__})") from None
        if not isinstance(tools, list) or not tools:
            raise InvalidArgument("tools", "must be a non-empty list of tools")
        refuse_lone_surrogates(tools, "tools")
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
            if not isinstance(function.get("strict", False), bool):
                raise InvalidArgument(f"{where}.function.strict", "must be true or false")
            parameters = function.get("parameters", NO_PARAMETERS)
            parameters = NO_PARAMETERS if parameters == {} else parameters  # absent or {}: no parameters, as OpenAI reads them
            if not isinstance(parameters, dict) or parameters.get("type") != "object":
                raise InvalidArgument(f"{where}.function.parameters", 'must be a JSON schema of an object ({"type": "object", ...}): '
                                      "a call's arguments are an object")
            depth = schema_depth(parameters)
            if depth > limits.max_schema_depth:
                raise InvalidArgument(f"{where}.function.parameters", f"nested {depth} deep; at most {limits.max_schema_depth}")
            functions.append(Function(name, _rebased(parameters, f"{where}.function.parameters", len(functions)), len(functions)))
        if request.choice is ToolChoice.FUNCTION and request.function not in names:
            raise InvalidArgument("tool_choice", f"names the function {request.function!r}, which is not among the tools")
        return tools, functions

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """The calls grammar (llguidance's Lark) of functions in this model's format, its marker included. Each function's
        parameters sit under the document's $defs (_rebased), where their own references still point into them."""
        call = {"type": "object", "properties": None, "required": ["name", self.rules.arguments_key], "additionalProperties": False}
        choices = [{**call, "properties": {"name": {"const": f.name}, self.rules.arguments_key: {"$ref": f"#/$defs/{f.key}"}}}
                   for f in functions]
        one_call = choices[0] if len(choices) == 1 else {"anyOf": choices}
        defs = {"$defs": {f.key: f.parameters for f in functions}}
        marker = self._literal(self.rules.marker)
        if self.format is CallFormat.MISTRAL:
            calls = {"type": "array", "items": one_call, "minItems": 1, **({} if parallel else {"maxItems": 1}), **defs,
                     "x-guidance": CALL_JSON_STYLE}
            return f"start: {marker} calls\ncalls: %json {json.dumps(calls)}\n"
        body = f"call_json: %json {json.dumps({**one_call, **defs, 'x-guidance': CALL_JSON_STYLE})}\n"
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
