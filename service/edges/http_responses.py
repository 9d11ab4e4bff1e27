"""The HTTP API's Responses endpoints (POST /v1/responses, GET and DELETE /v1/responses/{id}), mixed into HttpApi
(http_api.py), whose authorization, body reading and refusals they use: the transport of openai_responses.py's protocol."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..core.engine_errors import EngineError
from .http_disconnect import ClientGone, unless_disconnected
from .openai_errors import STATUS_CODES, ApiError, api_error
from .openai_responses import Answer, EventStream, as_responses_error, new_id, parse_responses


class ResponsesEndpoints:
    """HttpApi's Responses routes; self is the HttpApi (stored: its ResponseStore)."""

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: OpenAI's Responses API over the engine (openai_responses.py), whole or streamed as its events."""
        method = "Responses"
        try:
            self._authorized(request)
            engine = self.ready_engine()
            raw = await self._body(request, engine.limits)
            parsed, body, conversation = parse_responses(raw, self.model_name, engine.limits, engine.config.n_ctx, self.stored)
            events = engine.generate(parsed.request, batched=parsed.stream)  # streamed: the tokens ready together in one step()
            first = await unless_disconnected(request, anext(events))
        except ApiError as error:
            return self._refusal(method, error)
        except EngineError as exc:
            return self._refusal(method, as_responses_error(api_error(exc)))
        except ClientGone:
            self.metrics.on_request(method, "CANCELLED")
            return Response(status_code=499)
        answer = Answer(new_id("resp"), self.model_name, body)
        keep = body.get("store", True)
        if parsed.stream:
            return StreamingResponse(self._response_events(events, first, answer, conversation, keep, method), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answer.add(first)
        refused = await self._drain(request, events, answer.add, method, lambda exc: as_responses_error(api_error(exc)))
        if refused is not None:
            return refused
        if keep:
            self.stored.put(answer.response_id, answer.stored(conversation))
        self.metrics.on_request(method, "OK")
        return JSONResponse(answer.body())

    async def _response_events(self, events, first, answer: Answer, conversation: list[dict], keep: bool, method: str):
        stream, code = EventStream(answer), "OK"
        try:
            yield "".join(stream.start() + stream.step(first))
            async for batch in events:
                lines = stream.step(batch)
                if lines:
                    yield "".join(lines)  # one write for the tokens ready together
            for line in stream.finish():
                yield line
            if keep:
                self.stored.put(answer.response_id, answer.stored(conversation))
        except EngineError as exc:  # the response has started: the error goes in the stream
            error = as_responses_error(api_error(exc))
            code = STATUS_CODES[error.status]
            yield stream.event("error", code=error.code, message=error.message, param=error.param)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            await events.aclose()
            self.metrics.on_request(method, code)

    async def response_input_items(self, request: Request) -> Response:
        """GET /v1/responses/{id}/input_items: a stored response's own input, as a list (one page: has_more false)."""
        method = "ListInputItems"
        try:
            self._authorized(request)
            items = self.stored.get(request.path_params["response_id"]).input_items
        except ApiError as error:
            return self._refusal(method, error)
        self.metrics.on_request(method, "OK")
        return JSONResponse({"object": "list", "data": items, "first_id": items[0].get("id") if items else None,
                             "last_id": items[-1].get("id") if items else None, "has_more": False})

    async def stored_response(self, request: Request) -> Response:
        """GET or DELETE /v1/responses/{id}: a stored response, or its deletion."""
        method = "RetrieveResponse" if request.method == "GET" else "DeleteResponse"
        response_id = request.path_params["response_id"]
        try:
            self._authorized(request)
            if request.method == "DELETE":
                self.stored.delete(response_id)
                body = {"id": response_id, "object": "response", "deleted": True}
            else:
                body = self.stored.get(response_id).body
        except ApiError as error:
            return self._refusal(method, error)
        self.metrics.on_request(method, "OK")
        return JSONResponse(body)
