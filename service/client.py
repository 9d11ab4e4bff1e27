"""`kvserve generate`: a small streaming client, and the request builder the README's snippet mirrors."""

from __future__ import annotations

import sys
import time

import grpc

from kvserve.errors import UserError
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc


class RequestFailed(UserError):
    """The server refused or failed the request; the message carries its status code and details."""

    def __init__(self, error: grpc.RpcError):
        super().__init__(f"{error.code().name}: {error.details()}")
        self.code = error.code()
        self.exit_code = 2 if self.code == grpc.StatusCode.INVALID_ARGUMENT else 1


def stream_generation(target: str, prompt: str, max_new_tokens: int, temperature: float, seed: int, timeout: float, out=sys.stdout) -> dict:
    """Print the text as it streams, then one summary line; return the summary."""
    request = pb.GenerateRequest(
        text=prompt, max_new_tokens=max_new_tokens, sampling=pb.SamplingParams(temperature=temperature, seed=seed)
    )
    start = time.perf_counter()
    first = None
    tokens = 0
    finish = None
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            for response in stub.Generate(request, timeout=timeout, wait_for_ready=False):
                if response.HasField("token"):
                    tokens += 1
                    first = first or time.perf_counter()
                    out.write(response.token.text_delta)
                    out.flush()
                if response.HasField("finish"):
                    finish = response.finish
        except grpc.RpcError as error:
            out.write("\n")
            raise RequestFailed(error) from None
    elapsed = time.perf_counter() - start
    decode = elapsed - (first - start) if first else 0.0
    summary = {
        "tokens": tokens,
        "time_to_first_token_ms": (first - start) * 1e3 if first else None,
        "tokens_per_second": (tokens - 1) / decode if tokens > 1 and decode > 0 else None,
        "finish_reason": pb.FinishReason.Name(finish.reason) if finish else None,
    }
    ttft = f"{summary['time_to_first_token_ms']:.1f} ms" if first else "n/a"
    rate = f"{summary['tokens_per_second']:.1f} tokens/s" if summary["tokens_per_second"] else "n/a"
    reason = summary["finish_reason"].removeprefix("FINISH_REASON_").lower() if finish else "none"
    out.write(f"\n-- {tokens} tokens, time to first token {ttft}, {rate}, finished: {reason}\n")
    return summary


def check_health(target: str, wait_seconds: float = 0.0, service: str = "kvserve.v1.GenerationService") -> str:
    """Ask the gRPC health service; with wait_seconds, poll until SERVING or the time is up.
    Returns the last status name; raises RequestFailed if the server never answered."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + wait_seconds
    last_error = None
    status = "UNKNOWN"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                last_error = None
            except grpc.RpcError as error:
                last_error = error
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    if last_error is not None and status == "UNKNOWN":
        raise RequestFailed(last_error)
    return status
