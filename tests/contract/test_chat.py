"""contract/chat.py renders a conversation to the tokens transformers' apply_chat_template gives, on Llama-3-, Qwen2-,
Qwen3-, Gemma- and Phi-style templates with their special tokens (and a template's own variables), refuses what a
template refuses, and finds a template where checkpoints keep it."""

import json

import pytest

from kvserve.contract.chat import ChatMessage, ChatTemplateFileError, TemplateError, ToolCall, load_chat_template
from kvserve.contract.tokenizer import HFTokenizer

# Written in the style of the Llama 3 and Qwen2 templates: special tokens, header markers, a default system message,
# trim and loop variables, tojson on non-ASCII text.
LLAMA3_STYLE = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN2_STYLE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Written in the style of Qwen3's: the system turn first, a finished assistant turn's reasoning dropped from the history,
# and with enable_thinking false an empty reasoning block opened and closed after the assistant's header.
QWEN3_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Written in the style of Gemma's: no system role (its text opens the first user turn), the assistant called model,
# turns trimmed.
GEMMA_STYLE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# Written in the style of Phi-3's and Phi-4-mini's: a marker per role, each turn closed by <|end|>.
PHI_STYLE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] | tojson + eos_token }}{% endfor %}"
)
SPECIAL = {
    "llama3": (LLAMA3_STYLE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2": (QWEN2_STYLE, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>"),
    "alternating": (ALTERNATING, ["</s>"], None, "</s>"),
    "gemma": (GEMMA_STYLE, ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"),
    "phi": (PHI_STYLE, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], None, "<|endoftext|>"),
    "qwen3": (QWEN3_STYLE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"], None, "<|im_end|>"),
}
CONVERSATION = [
    ChatMessage("system", "Answer briefly."),
    ChatMessage("user", "  Who was Moses?  "),
    ChatMessage("assistant", "A prophet — «the lawgiver»."),
    ChatMessage("user", "And Aaron? 日本"),
]


def tokenizer_directory(tmp_path, gpt2_vocabulary, style: str, as_file: bool, spec: tuple | None = None):
    """GPT-2's BPE with the style's special tokens added (and BOS put first by its post-processor), its template in chat_template.jinja (as_file) or in
    tokenizer_config.json (as older checkpoints keep it)."""
    from tokenizers import Tokenizer

    template, special, bos, eos = spec or SPECIAL[style]  # spec: (template, special tokens, bos, eos) of a style not in SPECIAL
    directory = tmp_path / f"{style}-{as_file}"
    directory.mkdir()
    tokenizer = Tokenizer.from_file(str(gpt2_vocabulary))
    tokenizer.add_special_tokens(special)
    if bos:  # as Llama's tokenizer.json does: plain text is encoded with BOS first (its post-processor)
        from tokenizers.processors import TemplateProcessing

        tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    if bos:
        config["bos_token"] = bos
    if as_file:
        (directory / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def gpt2_vocabulary(tmp_path_factory):
    from kvserve.model.vocabulary import write_preset_tokenizer

    directory = tmp_path_factory.mktemp("gpt2-vocabulary")
    write_preset_tokenizer("gpt2", directory)
    return directory / "tokenizer.json"


@pytest.mark.parametrize("as_file", [True, False], ids=["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("style", ["llama3", "qwen2", "qwen3", "gemma", "phi"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_tokens_equal_transformers_apply_chat_template(tmp_path, gpt2_vocabulary, style, as_file, add_generation_prompt):
    import transformers

    directory = tokenizer_directory(tmp_path, gpt2_vocabulary, style, as_file)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    conversation = [{"role": m.role, "content": m.content} for m in CONVERSATION]
    want = reference.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
    template = load_chat_template(directory)
    got = HFTokenizer(directory / "tokenizer.json").encode(template.render(CONVERSATION, add_generation_prompt), add_special_tokens=False)
    assert got == list(want)
    assert template.special_tokens["eos_token"] == SPECIAL[style][3]


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": True}, {"enable_thinking": False}], ids=["none", "thinking", "not thinking"])
def test_template_variables_render_as_transformers_passes_its_keyword_arguments(tmp_path, gpt2_vocabulary, variables):
    """chat_template_kwargs: Qwen3's enable_thinking, given or not, on a conversation with a system prompt and an assistant
    turn whose reasoning the template drops."""
    import transformers

    directory = tokenizer_directory(tmp_path, gpt2_vocabulary, "qwen3", True)
    conversation = [ChatMessage("system", "Answer briefly."), ChatMessage("user", "Who was Moses?"),
                    ChatMessage("assistant", "<think>\nA lawgiver.\n</think>\n\nA prophet."), ChatMessage("user", "And Aaron?")]
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    want = reference.apply_chat_template([{"role": m.role, "content": m.content} for m in conversation], add_generation_prompt=True,
                                         tokenize=False, **variables)
    got = load_chat_template(directory).render(conversation, variables=variables)
    assert got == want and ("<think>\n\n</think>" in got) == (variables.get("enable_thinking") is False)
    with pytest.raises(TemplateError, match="'messages' is not a variable a caller may set"):
        load_chat_template(directory).render(conversation, variables={"messages": []})


def test_a_conversation_the_template_refuses_is_refused_with_its_own_words(tmp_path, gpt2_vocabulary):
    import transformers

    directory = tokenizer_directory(tmp_path, gpt2_vocabulary, "alternating", True)
    template = load_chat_template(directory)
    fine = [ChatMessage("user", "«hi»"), ChatMessage("assistant", "hello")]
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    assert template.render(fine, False) == reference.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in fine], tokenize=False)
    with pytest.raises(TemplateError, match="roles must alternate"):
        template.render([ChatMessage("user", "a"), ChatMessage("user", "b")])


def test_the_sandbox_keeps_a_template_from_reaching_python(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match="failed on this conversation"):
        load_chat_template(tmp_path).render([ChatMessage("user", "x")])
    (tmp_path / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(TemplateError):
        load_chat_template(tmp_path).render([ChatMessage("user", "x")])


def test_no_template_is_none_and_named_templates_give_the_default(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}"}]}))
    assert load_chat_template(tmp_path).render([ChatMessage("user", "x")]) == "x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({  # special tokens as older configs write them
        "chat_template": "{{ bos_token }}{{ eos_token }}", "bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>"}))
    assert load_chat_template(tmp_path).render([ChatMessage("user", "x")]) == "<s></s>"


@pytest.mark.parametrize(
    "files, message",
    [
        ({"chat_template.jinja": b"{% for %}"}, "chat_template.jinja: its chat template does not compile (line 1: TemplateSyntaxError"),
        ({"chat_template.jinja": b"ok\n{{ messages[0] "}, "chat_template.jinja: its chat template does not compile (line 2:"),
        ({"tokenizer_config.json": json.dumps({"chat_template": "{% if %}"}).encode()},
         "tokenizer_config.json: its chat template does not compile"),
        ({"chat_template.jinja": b"\xff\xfe"}, "chat_template.jinja: not UTF-8 text"),
        ({"tokenizer_config.json": b"{nope"}, "tokenizer_config.json: not valid JSON"),
        ({"tokenizer_config.json": b"[]"}, "tokenizer_config.json: not a JSON object"),
    ],
    ids=["jinja file", "second line", "in tokenizer_config", "jinja not utf-8", "config not json", "config a list"],
)
def test_a_template_that_does_not_compile_or_read_is_named_with_its_file(tmp_path, files, message):
    """jinja's and json's errors name no file: the server printed a traceback at start, export shipped the file."""
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ChatTemplateFileError) as error:
        load_chat_template(tmp_path)
    assert str(error.value).startswith(str(tmp_path)) and message in str(error.value)


def test_the_default_models_template_is_documented_plain_text():
    from ..conftest import DEFAULT_CHECKPOINT

    template = load_chat_template(DEFAULT_CHECKPOINT)
    text = template.render([ChatMessage("system", "Be brief."), ChatMessage("user", "Who was Moses?")])
    assert text == "Be brief.\n\nUser: Who was Moses?\nAssistant:"


def test_the_default_models_template_lists_tools_and_writes_calls_as_hermes_blocks():
    """Tools first, a function a line; a turn's calls as <tool_call> blocks after its content; a tool turn a line."""
    from ..conftest import DEFAULT_CHECKPOINT

    template = load_chat_template(DEFAULT_CHECKPOINT)
    tools = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]
    conversation = [ChatMessage("user", "Flood?"), ChatMessage("assistant", "", (ToolCall("c1", "find", '{"book": "Genesis"}'),)),
                    ChatMessage("tool", "Genesis 7", tool_call_id="c1")]
    assert template.knows_tools and template.render(conversation, tools=tools) == (
        'Tools:\n{"name": "find", "parameters": {"type": "object"}}\n'
        'Call one as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>\n\n'
        'User: Flood?\nAssistant: <tool_call>\n{"name": "find", "arguments": {"book": "Genesis"}}\n</tool_call>\nTool: Genesis 7\nAssistant:')


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city — «météo»",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
TOOL_SPECIAL = {
    "hermes": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>"),
    "llama3_json": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]"], "<s>", "</s>"),
}


@pytest.mark.parametrize("style", ["hermes", "llama3_json", "mistral"])
def test_tools_and_tool_turns_render_as_transformers_passes_them(tmp_path, gpt2_vocabulary, style):
    """tools (as transformers' apply_chat_template(tools=...) passes OpenAI's entries), an assistant turn's tool_calls (with
    their arguments as an object) and a tool turn's result, on a conversation with a system prompt."""
    import transformers

    from ..conftest import TOOL_TEMPLATES

    directory = tokenizer_directory(tmp_path, gpt2_vocabulary, style, True, (TOOL_TEMPLATES[style], *TOOL_SPECIAL[style]))
    call = ToolCall("a1B2c3D4e", "get_weather", json.dumps({"city": "Zürich"}, ensure_ascii=False))
    conversation = [ChatMessage("system", "Use the tools."), ChatMessage("user", "Weather in Zürich?"),
                    ChatMessage("assistant", "", (call,)), ChatMessage("tool", '{"celsius": 21}', tool_call_id=call.id, name="get_weather"),
                    ChatMessage("user", "And now?")]
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    as_client_sends = [{"role": m.role, "content": m.content} for m in conversation]
    as_client_sends[2]["tool_calls"] = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": {"city": "Zürich"}}}]
    as_client_sends[3].update(tool_call_id=call.id, name="get_weather")
    want = reference.apply_chat_template(as_client_sends, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    template = load_chat_template(directory)
    got = template.render(conversation, tools=TOOLS)
    assert got == want and "get_weather" in got and "Zürich" in got
    assert template.knows_tools
    assert template.render(conversation[:2]) == reference.apply_chat_template(as_client_sends[:2], add_generation_prompt=True, tokenize=False)
