"""A request checked against the model and the limits (service/core/validation.py): every refusal an InvalidArgument that
names the field and the bound, what is accepted made into a Sequence as asked."""

import pytest

from kvserve.contract.chat import ChatMessage, load_chat_template
from kvserve.contract.tokenizer import ByteTokenizer
from kvserve.model.presets import preset
from kvserve.service.core.engine_errors import InvalidArgument
from kvserve.service.core.limits import EngineLimits
from kvserve.service.core.sampling import SamplingParams
from kvserve.service.core.sequence import GenerationRequest
from kvserve.service.core.structured import FormatKind, ResponseFormat
from kvserve.service.core.tool_calls import ToolRequest
from kvserve.service.core.validation import INLINE_CHARACTERS, INLINE_TOKEN_IDS, RequestValidator, validates_inline

from ...conftest import DEFAULT_CHECKPOINT

CONFIG = preset("tiny")  # 257 ids (256 bytes + end of sequence), a 256-token context


@pytest.fixture(scope="module")
def validator():
    return RequestValidator(CONFIG, ByteTokenizer(), EngineLimits(max_text_bytes=64, max_chat_messages=2, max_role_length=6),
                            load_chat_template(DEFAULT_CHECKPOINT))


REFUSED = [
    (dict(prompt_text="a", prompt_ids=(1,)), "prompt: give one of text, token_ids or messages"),
    (dict(prompt_text=""), "prompt.text: the prompt is empty"),
    (dict(prompt_text="x" * 65), "prompt.text: 65 bytes of text; at most 64"),
    (dict(prompt_ids=(1, 257)), "prompt.token_ids: token id 257 is outside the vocabulary [0, 257)"),
    (dict(prompt_ids=(1,) * 256), "prompt.token_ids: the prompt has 256 tokens; the context holds 256"),
    (dict(prompt_ids=(1,) * 250, max_new_tokens=7), "max_new_tokens: 7 new tokens do not fit"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(temperature=1e-9)), "sampling.temperature: must be 0 (greedy) or in [1e-06, 1e+06]"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(top_k=-1)), "sampling.top_k: must be >= 0"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(top_p=0.0)), "sampling.top_p: must be in (0, 1]"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(min_p=1.5)), "sampling.min_p: must be in [0, 1]"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(presence_penalty=2.5)), "sampling.presence_penalty: must be in [-2, 2]"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(repetition_penalty=0.0)), "sampling.repetition_penalty: must be in [1e-06, 1e+06]"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(logit_bias=((300, 1.0),))), "sampling.logit_bias: token id 300 is outside"),
    (dict(prompt_ids=(1,), sampling=SamplingParams(logit_bias=((3, 101.0),))), "sampling.logit_bias: the bias of token 3 must be in"),
    (dict(prompt_ids=(1,), top_logprobs=2), "top_logprobs: alternatives come with the log-probabilities"),
    (dict(prompt_ids=(1,), return_logprobs=True, top_logprobs=21), "top_logprobs: must be in [0, 20], got 21"),
    (dict(prompt_ids=(1,), stop_sequences=("x" * 257,)), "stop_sequences: a stop sequence of 257 characters; at most 256"),
    (dict(prompt_ids=(1,), stop_token_ids=(999,)), "stop_token_ids: token id 999 is outside the vocabulary"),
    (dict(prompt_messages=()), "prompt.messages: the conversation has no messages"),
    (dict(prompt_messages=(ChatMessage("user", "a"),) * 3), "prompt.messages: 3 messages; at most 2"),
    (dict(prompt_messages=(ChatMessage("speaker", "a"),)), "prompt.messages[0].role: must be 1 to 6 characters, got 7"),
    (dict(prompt_ids=(1,), response_format=ResponseFormat(FormatKind.REGEX, "[")), "response_format.regex"),
]


@pytest.mark.parametrize("fields, message", REFUSED, ids=[m.split(":")[0] + f" {i}" for i, (_, m) in enumerate(REFUSED)])
def test_each_refusal_names_its_field_and_bound(validator, fields, message):
    with pytest.raises(InvalidArgument) as refused:
        validator.make_sequence(GenerationRequest(**fields))
    assert message in str(refused.value)
    assert refused.value.field == message.split(":")[0]


def test_an_accepted_request_becomes_the_sequence_it_asked_for(validator):
    seq = validator.make_sequence(GenerationRequest(prompt_text="Hi", max_new_tokens=0, stop_token_ids=(7,), return_logprobs=True,
                                                    top_logprobs=2))
    assert seq.prompt_ids == list(b"Hi") and seq.max_new_tokens == CONFIG.n_ctx - 2  # 0: as many as fit
    assert seq.stop_ids == {7, *CONFIG.eos_token_ids} and seq.top_logprobs == 2 and seq.params.seed != 0  # a seed chosen
    other = validator.make_sequence(GenerationRequest(prompt_ids=(1, 2), ignore_eos=True, sampling=SamplingParams(seed=5)))
    assert other.stop_ids == frozenset() and other.params.seed == 5 and other.id > seq.id
    chat = validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),)))
    assert len(chat.prompt_ids) > 2  # rendered by the template: more than the message's own bytes


def test_a_model_without_a_chat_template_refuses_a_conversation_by_saying_so():
    bare = RequestValidator(CONFIG, ByteTokenizer(), EngineLimits())
    with pytest.raises(InvalidArgument, match="prompt.messages: this model has no chat template"):
        bare.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),)))


def test_under_a_kv_budget_as_many_as_fit_is_what_it_holds_and_what_never_fits_is_refused_naming_it():
    budgeted = RequestValidator(CONFIG, ByteTokenizer(), EngineLimits(), kv_budget_tokens=100)
    assert budgeted.make_sequence(GenerationRequest(prompt_ids=(1,) * 30)).max_new_tokens == 70  # 0: as many as the budget holds
    assert budgeted.make_sequence(GenerationRequest(prompt_ids=(1,) * 30, max_new_tokens=70)).max_new_tokens == 70
    with pytest.raises(InvalidArgument, match=r"max_new_tokens: 71 new tokens after a 30-token prompt do not fit: the server's K/V "
                                              r"budget holds 100 tokens \(--kv-cache-memory\), so at most 70 new tokens"):
        budgeted.make_sequence(GenerationRequest(prompt_ids=(1,) * 30, max_new_tokens=71))
    with pytest.raises(InvalidArgument, match=r"prompt.token_ids: the prompt has 100 tokens; the server's K/V budget holds 100 tokens"):
        budgeted.make_sequence(GenerationRequest(prompt_ids=(1,) * 100))


def test_only_small_requests_without_a_grammar_are_validated_on_the_event_loop():
    assert validates_inline(GenerationRequest(prompt_ids=(1,) * INLINE_TOKEN_IDS))
    assert not validates_inline(GenerationRequest(prompt_ids=(1,) * (INLINE_TOKEN_IDS + 1)))
    assert validates_inline(GenerationRequest(prompt_text="a" * INLINE_CHARACTERS))
    assert not validates_inline(GenerationRequest(prompt_text="a" * (INLINE_CHARACTERS + 1)))
    assert not validates_inline(GenerationRequest(prompt_messages=(ChatMessage("user", "hi"),)))  # its template renders off the loop
    assert not validates_inline(GenerationRequest(prompt_ids=(1,), response_format=ResponseFormat(FormatKind.REGEX, "a+")))
    assert not validates_inline(GenerationRequest(prompt_text="hi", tools=ToolRequest("[]")))
