"""The OpenAI-compatible HTTP API over the engine's thread: request bodies (a refused one is a 4xx naming
the field), completions and chat completions (whole, or streamed as server-sent events), /v1/models,
/health and /metrics. Everything about decoding is the engine's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from specjax.engine import Request, RequestError
from specjax.serve._config import ServeConfig
from specjax.serve._metrics import ServerMetrics
from specjax.serve._runner import DONE, FAILED, TOKENS, EngineRunner, EventReader
from specjax.serve._spec_metrics import spec_decode_metrics
from specjax.serve._text import PLAIN_CHAT_TEMPLATE, Detokenizer

log = logging.getLogger("specjax.serve")

DISCONNECT_POLL_S = 0.5  # how often a whole (not streamed) response checks that its client is still there


# ---------------------------------------------------------------------------------------- request bodies

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share. Unknown fields are refused, not ignored: a client
    asking for something this server does not do (stop strings, logprobs, penalties) hears so."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # None: 1, OpenAI's default; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 and -1 disable it
    seed: int | None = Field(None, ge=0, lt=2 ** 32)  # None: a random seed
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] = []  # vLLM's extension: ids that end the request besides the EOS
    user: str | None = None  # accepted and unused, as OpenAI's clients send it


class CompletionBody(SamplingFields):
    prompt: str | list[int]  # text, or token ids
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens


class HTTPError(Exception):
    """A refused request: its status, the message (naming the field) and the field (OpenAI's `param`)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
            503: "ServiceUnavailableError"}.get(status, "ServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


# --------------------------------------------------------------------------------------------- the server

@dataclasses.dataclass
class Served:
    """What the handlers share: the config, the engine's thread, the tokenizer, the counters, and the
    shutdown's state."""

    config: ServeConfig
    runner: EngineRunner
    tokenizer: Any
    metrics: ServerMetrics
    lookahead: int  # cache entries a step writes past the last token (EngineConfig.lookahead)
    draining_since: float | None = None  # time.monotonic() of SIGTERM / SIGINT
    trace_dir: Path | None = None  # the profiler trace being taken (/start_profile), if one is
    shutdown_aborted: bool = False  # the drain timed out and the requests left were ended

    def begin_drain(self) -> None:
        """Stops taking requests; those in flight get shutdown_timeout_s to finish (called by the signal)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            log.info("shutting down: new requests get 503; %d in flight have %.0f s to finish",
                     self.runner.in_flight(), self.config.shutdown_timeout_s)

    def encode(self, text: str) -> list[int]:
        """Token ids of text, after the BOS as `specjax generate` encodes prompts."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        return ids if bos is None or ids[:1] == [bos] else [bos, *ids]

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        template = None if self.tokenizer.chat_template else PLAIN_CHAT_TEMPLATE
        text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                                  chat_template=template, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def request(self, request_id: str, body: SamplingFields, prompt: list[int], max_tokens: int | None) -> Request:
        """The engine's request, checked by the engine now (a RequestError is a 400 naming the field)."""
        if body.model is not None and body.model != self.config.model_name:
            raise HTTPError(404, f"model {body.model!r} does not exist: allowed {self.config.model_name!r}", "model")
        if body.n != 1:
            why = ("per-request speculative metrics are for n == 1 only (vLLM's rule)"
                   if self.config.per_request_spec_decode_metrics != "none" else "this server samples one choice")
            raise HTTPError(400, f"n = {body.n} is invalid: allowed 1 ({why})", "n")
        if max_tokens is None:  # chat without a budget: what the context leaves
            max_tokens = self.config.max_model_len - len(prompt) - self.lookahead
            if max_tokens < 1:
                raise HTTPError(400, f"the prompt ({len(prompt)} tokens) leaves no room for a reply in max_model_len "
                                f"{self.config.max_model_len}", "messages")
        seed = secrets.randbelow(2 ** 32) if body.seed is None else body.seed
        try:
            request = Request.make(request_id, prompt, max_tokens, temperature=1.0 if body.temperature is None
                                   else body.temperature, top_k=max(body.top_k, 0),
                                   top_p=1.0 if body.top_p is None else body.top_p, seed=seed,
                                   stop_token_ids=body.stop_token_ids)
            self.runner.check(request)
        except RequestError as error:
            message = str(error)
            param = next((f for f in ("max_tokens", "stop_token_ids", "prompt", "temperature", "top_p", "top_k")
                          if f in message), None)
            raise HTTPError(400, message, param) from error
        return request

    def spec_metrics(self, output) -> dict | None:
        return spec_decode_metrics(output.metrics, self.config.per_request_spec_decode_metrics)


def access_log(request_id: str, status: int, path: str, prompt_tokens: int, output=None, start: float = 0.0,
               note: str = "") -> None:
    """One line per request: id, status, tokens, time to first token, total time, mean acceptance length."""
    if output is None:
        log.info("%s %d %s prompt_tokens=%d %s", request_id, status, path, prompt_tokens, note)
        return
    now = time.perf_counter()
    ttft = "-" if output.first_token_time is None else f"{output.first_token_time - start:.3f}s"
    summary = spec_decode_metrics(output.metrics, "summary")
    tau = f"{summary['mean_acceptance_length']:.2f}" if summary and summary["num_spec_steps"] else "-"
    log.info("%s %d %s prompt_tokens=%d completion_tokens=%d finish=%s ttft=%s total=%.3fs "
             "mean_acceptance_length=%s%s", request_id, status, path, prompt_tokens, len(output.tokens),
             output.finish_reason, ttft, now - start, tau, f" {note}" if note else "")


def build_app(served: Served) -> FastAPI:
    config = served.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def end_the_drain():  # after shutdown_timeout_s of draining, the requests left end with an error
            while served.draining_since is None or time.monotonic() - served.draining_since < config.shutdown_timeout_s:
                await asyncio.sleep(0.1)
            served.shutdown_aborted = True
            ids = served.runner.abort_all()
            if ids:
                log.warning("shutdown timeout (%.0f s): ending %d requests: %s", config.shutdown_timeout_s,
                            len(ids), " ".join(ids))

        watcher = asyncio.create_task(end_the_drain())
        yield
        watcher.cancel()

    app = FastAPI(title="specjax", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: HTTPRequest, error: RequestValidationError):
        first = error.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        param, name = (where[0] if where else None), ".".join(where) or "the body"
        if first["type"] == "json_invalid":
            message, param = f"malformed JSON: {first['msg']}", None
        elif first["type"] == "extra_forbidden":
            message = f"{name} is not supported by this server"
        elif first["type"] == "missing":
            message = f"{name} is missing"
        else:
            message = f"{name} = {first.get('input')!r} is invalid: {first['msg']}"
        access_log("-", 400, request.url.path, 0, note=message)
        return error_response(400, message, param)

    @app.get("/health")
    async def health():
        if served.runner.failure is not None:
            return error_response(503, served.runner.failure)
        if served.draining_since is not None:
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specjax", "root": config.model,
                                            "max_model_len": config.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(served.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/start_profile")
    async def start_profile():
        if config.profile_dir is None:
            return error_response(404, "profiling is off: start the server with --profile-dir DIR")
        if served.trace_dir is not None:
            return error_response(409, f"a trace is being taken already, into {served.trace_dir}: "
                                       "POST /stop_profile first")
        served.trace_dir = Path(config.profile_dir) / time.strftime("trace_%Y%m%d_%H%M%S")
        await asyncio.to_thread(served.runner.start_profile, served.trace_dir)
        log.info("profiling into %s", served.trace_dir)
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile():
        if config.profile_dir is None:
            return error_response(404, "profiling is off: start the server with --profile-dir DIR")
        if served.trace_dir is None:
            return error_response(409, "no trace is being taken: POST /start_profile first")
        trace_dir, served.trace_dir = served.trace_dir, None
        # Writing and reading the trace take seconds: off the event loop, which goes on serving.
        summary = await asyncio.to_thread(served.runner.stop_profile, trace_dir)
        log.info("profile written: %s", summary)
        return summary

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt = list(body.prompt) if isinstance(body.prompt, list) else served.encode(body.prompt)
        return await generate(request_id, "completion", body, prompt, body.max_tokens, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await generate(request_id, "chat", body, served.chat_prompt(body.messages), max_tokens, http)

    async def generate(request_id: str, kind: str, body: SamplingFields, prompt: list[int], max_tokens: int | None,
                       http: HTTPRequest):
        start, path = time.perf_counter(), http.url.path
        try:
            if served.draining_since is not None or served.runner.failure is not None:
                raise HTTPError(503, "the server is shutting down" if served.runner.failure is None
                                else served.runner.failure)
            request = served.request(request_id, body, prompt, max_tokens)
            queue = served.runner.submit(request)
        except HTTPError as error:
            access_log(request_id, error.status, path, len(prompt), note=error.message)
            return error_response(error.status, error.message, error.param)
        shape = Shape(kind, request_id, config.model_name, len(prompt))
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(shape, queue, usage, start, path), media_type="text/event-stream")
        return await whole(shape, queue, http, start, path)

    async def whole(shape: Shape, queue: asyncio.Queue, http: HTTPRequest, start: float, path: str):
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while True:
            try:
                kind, value = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                kind = None
            if time.monotonic() >= next_check:  # between events too: tokens may come at every visit
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await http.is_disconnected():
                    served.runner.abort(shape.request_id)
                    access_log(shape.request_id, 499, path, shape.prompt_tokens, note="client disconnected")
                    return Response(status_code=499)
            if kind == FAILED:
                access_log(shape.request_id, 500, path, shape.prompt_tokens, note=value)
                return error_response(500, value)
            if kind == DONE:
                break
        output = value
        if output.finish_reason in ("abort", "error"):
            status, message = ended_badly(output)
            access_log(shape.request_id, status, path, shape.prompt_tokens, output, start, message)
            return error_response(status, message)
        access_log(shape.request_id, 200, path, shape.prompt_tokens, output, start)
        text = served.tokenizer.decode(list(output.tokens), skip_special_tokens=True)
        return shape.whole(text, output, served.spec_metrics(output))

    def ended_badly(output) -> tuple[int, str]:
        if output.finish_reason == "error":
            return 400, output.error or "the engine refused the request"
        if served.shutdown_aborted:
            return 503, (f"the server shut down before this request finished ({len(output.tokens)} tokens made in "
                         f"the {config.shutdown_timeout_s:.0f} s it waits for requests in flight)")
        return 503, "the request was aborted"

    async def stream(shape: Shape, queue: asyncio.Queue, usage: bool, start: float, path: str):
        detokenizer, output, status, note = Detokenizer(served.tokenizer), None, 499, "client disconnected"
        # The events ready at once (a visit's tokens, and the request's end with it) go out as one write: each
        # write is a send through the ASGI stack and a system call, the event loop's largest cost a request.
        pending = [shape.sse(shape.chunk("", role=True))] if shape.kind == "chat" else []
        try:
            events = EventReader(queue)  # a loop behind the engine sends the tokens that piled up as one chunk
            while True:
                if pending and not events.ready():
                    yield "".join(pending)
                    pending = []
                kind, value = await events.next()
                if kind == TOKENS:
                    text = detokenizer.add(value)
                    if text:
                        pending.append(shape.sse(shape.chunk(text)))
                    continue
                if kind == FAILED:
                    status, note = 500, value
                    pending.append(shape.sse({"error": {"message": value, "type": "ServerError", "code": 500}}))
                    break
                output = value
                if output.finish_reason in ("abort", "error"):
                    status, note = ended_badly(output)
                    pending.append(shape.sse({"error": {"message": note, "type": "ServerError", "code": status}}))
                    break
                status, note = 200, ""
                pending.append(shape.sse(shape.chunk(detokenizer.add([], final=True),
                                                     finish_reason=output.finish_reason)))
                if usage:
                    pending.append(shape.sse(shape.usage_chunk(output, served.spec_metrics(output))))
                break
            yield "".join(pending) + "data: [DONE]\n\n"
        finally:  # also when the client went away (the generator is closed): its slot is freed
            if status == 499:
                served.runner.abort(shape.request_id)
            access_log(shape.request_id, status, path, shape.prompt_tokens, output, start, note)

    return app


@dataclasses.dataclass(frozen=True)
class Shape:
    """OpenAI's response objects for one request: a completion's or a chat completion's, whole or chunked."""

    kind: str  # 'completion' or 'chat'
    request_id: str
    model: str
    prompt_tokens: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _head(self, object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}

    def usage(self, output) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(output.tokens),
                "total_tokens": self.prompt_tokens + len(output.tokens)}

    def whole(self, text: str, output, metrics: dict | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": output.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
        response = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        response |= {"choices": [choice], "usage": self.usage(output)}
        if metrics is not None:
            response["metrics"] = {"speculative_decoding": metrics}
        return response

    def chunk(self, text: str, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion") | {"choices": [choice]}

    def usage_chunk(self, output, metrics: dict | None) -> dict:
        """The final chunk of a stream with stream_options.include_usage: no choices, the usage and metrics."""
        chunk = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        chunk |= {"choices": [], "usage": self.usage(output)}
        if metrics is not None:
            chunk["metrics"] = {"speculative_decoding": metrics}
        return chunk

    @staticmethod
    def sse(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"
