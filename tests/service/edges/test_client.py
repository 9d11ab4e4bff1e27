"""`kvserve generate`'s client (service/edges/client.py): the text it writes and the tokens it counts, from a server
that puts several tokens in a message and from one older than that (one token a message, batch_tokens ignored)."""

import io
from concurrent import futures

import grpc

from kvserve.service.edges.client import stream_generation
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..conftest import collect


class OneTokenAMessage(pb_grpc.GenerationServiceServicer):
    """A server older than batch_tokens: it streams "abcde", a token a message, whatever the request asks."""

    def Generate(self, request, context):
        for index, letter in enumerate("abcde"):
            finish = pb.FinishDetails(reason=pb.FINISH_REASON_LENGTH, generated_tokens=5) if index == 4 else None
            yield pb.GenerateResponse(token=pb.Token(id=index, text_delta=letter), finish=finish)


def test_the_client_writes_every_token_whether_the_server_batches_them_or_not(server, stub):
    want_ids, want_text, _ = collect(stub, pb.GenerateRequest(text="In the", max_new_tokens=16))
    out = io.StringIO()
    summary = stream_generation(server.target, "In the", 16, 0.0, 0, 60, out=out)
    assert out.getvalue().startswith(want_text) and summary["tokens"] == len(want_ids) == 16  # then its summary line

    older = grpc.server(futures.ThreadPoolExecutor(1))
    pb_grpc.add_GenerationServiceServicer_to_server(OneTokenAMessage(), older)
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        out = io.StringIO()
        summary = stream_generation(f"127.0.0.1:{port}", "x", 5, 0.0, 0, 30, out=out)
    finally:
        older.stop(None)
    assert out.getvalue().startswith("abcde\n") and summary["tokens"] == 5 and summary["finish_reason"] == "FINISH_REASON_LENGTH"
