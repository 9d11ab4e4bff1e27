"""The gRPC servicer's translation of a stream (service/edges/grpc_servicer.py): batch_tokens, several tokens a message,
gives the one-token stream's tokens, text and finish, for one completion and for n."""

from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect

PROMPT = [70, 71, 72, 73]


def batched(stub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    request.batch_tokens = True
    return list(stub.Generate(request, timeout=60))


def test_a_batched_stream_carries_the_one_token_streams_tokens_text_and_finish(stub):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=24, ignore_eos=True)
    ids, text, finish = collect(stub, request)
    responses = batched(stub, request)
    assert all(not r.HasField("token") and len(r.tokens) >= 1 for r in responses)
    assert [t.id for r in responses for t in r.tokens] == ids and "".join(t.text_delta for r in responses for t in r.tokens) == text
    assert [r.HasField("finish") for r in responses] == [False] * (len(responses) - 1) + [True]
    last = responses[-1].finish
    assert (last.reason, last.generated_tokens, last.prompt_tokens) == (finish.reason, 24, len(PROMPT))


def test_tokens_a_grammar_forces_in_one_step_come_in_one_message(stub):
    """A regular expression that leaves the model no choice: its drafts are all taken in a step or two, and their tokens
    go out together."""
    forced = "kvserve sends what it has"
    request = pb.GenerateRequest(text="x", max_new_tokens=64, response_format=pb.ResponseFormat(regex=forced))
    responses = batched(stub, request)
    assert "".join(t.text_delta for r in responses for t in r.tokens) == forced
    assert max(len(r.tokens) for r in responses) > 1 and len(responses) < len(forced)
    assert responses[-1].finish.accepted_draft_tokens > 0


def test_batched_n_completions_are_each_the_one_token_streams(stub):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=8, ignore_eos=True, n=2,
                                 sampling=pb.SamplingParams(temperature=1.0, seed=5))
    plain = {0: [], 1: []}
    for response in stub.Generate(request, timeout=60):
        plain[response.index].append(response.token.id)
    together = {0: [], 1: []}
    finishes = {}
    for response in batched(stub, request):
        together[response.index] += [t.id for t in response.tokens]
        if response.HasField("finish"):
            finishes[response.index] = response.finish.generated_tokens
    assert together == plain and finishes == {0: 8, 1: 8}
