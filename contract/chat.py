"""The artifact's chat template: how a conversation becomes the prompt the model was trained to see. No torch.

A checkpoint's tokenizer files carry it (transformers writes `chat_template.jinja`; older checkpoints keep it in
tokenizer_config.json under "chat_template", a string or a list of named templates), and export copies them into
the artifact. It is rendered as transformers' `apply_chat_template` renders it: Jinja in an immutable sandbox (a
template can read the conversation it is given and nothing else), blocks trimmed, loop controls, a `tojson` filter
that keeps non-ASCII text, `raise_exception` for the template's own checks, and the tokenizer's special tokens
(bos_token, eos_token, ...) as variables; the text is then tokenized without adding special tokens (the template
writes them). Tools reach the template as transformers passes them (`tools`: OpenAI's function entries), and a
conversation's tool calls as its messages carry them (`tool_calls` with arguments as an object, `tool_call_id`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from kvserve.errors import UserError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# What render() itself gives a template; a caller's extra variables (chat_template_kwargs) may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", *SPECIAL_TOKEN_NAMES})


class TemplateError(ValueError):
    """A conversation the template refuses (its raise_exception), or a template that fails to render it."""


class ChatTemplateFileError(UserError):
    """A tokenizer_config.json or chat_template.jinja that cannot be read, or a template that does not compile; the message
    names the file."""


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made: its id, the function's name and its arguments (a JSON object, as text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None  # a tool turn: the function that answered (older templates read it)

    def as_template_reads_it(self) -> dict:
        """The message as a client hands it to transformers' apply_chat_template: keys only where set (templates test
        `'tool_calls' in message`), arguments parsed to an object (templates write them with tojson)."""
        message = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the Jinja text
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...: their text

    def __post_init__(self):
        from jinja2 import meta

        compiled = _compile(self.source)
        object.__setattr__(self, "_compiled", compiled)
        # Whether the template reads a `tools` variable: one that does not would drop them from the prompt.
        object.__setattr__(self, "knows_tools", "tools" in meta.find_undeclared_variables(compiled.environment.parse(self.source)))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True, variables: dict | None = None,
               tools: list[dict] | None = None) -> str:
        """The prompt text for messages, ending with the assistant's turn opened when add_generation_prompt; variables are
        the template's extra ones (transformers' apply_chat_template **kwargs: Qwen3's enable_thinking, say), none of
        RESERVED_TEMPLATE_VARIABLES; tools: OpenAI's tool entries ({"type": "function", "function": {...}}), or None."""
        conversation = [m.as_template_reads_it() for m in messages]
        extra = dict(variables or {})
        if set(extra) & RESERVED_TEMPLATE_VARIABLES:
            raise TemplateError(f"{sorted(set(extra) & RESERVED_TEMPLATE_VARIABLES)[0]!r} is not a variable a caller may set")
        if tools:
            extra["tools"] = tools
        try:
            # One mapping, not keyword arguments: a caller's variable may be named as render's own ("self").
            return self._compiled.render({**extra, "messages": conversation, "add_generation_prompt": add_generation_prompt, **self.special_tokens})
        except TemplateError:
            raise
        except Exception as exc:  # the sandbox refusing an attribute, a type error in the template's logic, ...
            raise TemplateError(f"the model's chat template failed on this conversation: {type(exc).__name__}: {exc}") from exc


def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(f"the model's chat template refused the conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(source)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template in an artifact (or checkpoint) directory, with its special tokens; None when it has none."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _read_tokenizer_config(config_path) if config_path.exists() else {}
    template_path = directory / CHAT_TEMPLATE_FILE
    if template_path.exists():
        source, origin = _read_text(template_path), template_path
    else:
        source, origin = config.get("chat_template"), config_path
    if isinstance(source, list):  # named templates: the one named "default" is the chat template
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source.strip():
        return None
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    try:
        return ChatTemplate(source, special)
    except Exception as exc:  # jinja's syntax errors name a line of no file
        line = f"line {exc.lineno}: " if getattr(exc, "lineno", None) else ""
        raise ChatTemplateFileError(f"{origin}: its chat template does not compile ({line}{type(exc).__name__}: {exc})") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateFileError(f"{path}: not UTF-8 text ({exc})") from None


def _read_tokenizer_config(path: Path) -> dict:
    try:
        config = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ChatTemplateFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ChatTemplateFileError(f"{path}: not a JSON object")
    return config
