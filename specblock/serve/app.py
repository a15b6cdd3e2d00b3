"""The HTTP surface: OpenAI's endpoints on FastAPI, in front of one engine worker.

Handlers parse and check a request, encode its prompt exactly as the CLI does (runtime/chat.py),
queue a job and turn the worker's events into a JSON body or server-sent events. Nothing here
touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specblock.errors import SpecBlockError
from specblock.runtime.chat import ChatRequest, encode, parse_messages
from specblock.runtime.cli import Session
from specblock.serve.metrics import CONTENT_TYPE, ServeMetrics
from specblock.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, Shape, parse, speculative, usage
from specblock.serve.worker import CLIENT_GONE, Delta, Done, EngineWorker, Event, Failed, Job


@dataclass
class ServeSettings:
    model_name: str  # the id clients send as "model" and /v1/models lists
    aliases: frozenset[str] = frozenset()  # other accepted ids (the --target as given)
    max_queue: int = 64
    disconnect_poll_s: float = 0.25  # how often a non-streaming request checks that its client is there


class Service:
    """One loaded model behind the API: request checks, prompt encoding, the worker, the metrics."""

    def __init__(self, session: Session, settings: ServeSettings) -> None:
        self.session, self.settings = session, settings
        self.metrics = ServeMetrics()
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe under concurrent use
        self.worker = EngineWorker(session, self.metrics, settings.max_queue, self.tokenizer_lock)
        self.started = int(time.time())

    # -- requests -----------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name and name not in self.settings.aliases:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.settings.model_name}' (GET /v1/models)", param="model", code="model_not_found")

    def encode(self, req: ChatCompletionRequest | CompletionRequest) -> list[int]:
        tok = self.session.tokenizer
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):  # token ids
            vocab = self.session.target.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in req.prompt):
                raise APIError(400, f"prompt: token ids must lie in [0, {vocab})", param=param, code="invalid_value")
            ids = list(req.prompt)
        else:
            try:
                if isinstance(req, ChatCompletionRequest):
                    creq = ChatRequest(messages=parse_messages(req.messages, "messages"))
                else:  # the completions endpoint continues text as given, as the CLI's --raw
                    creq = ChatRequest(prompt=req.prompt, raw=True)
                with self.tokenizer_lock:
                    ids = encode(tok, creq)
            except SpecBlockError as e:
                raise APIError(400, str(e), param=param, code="invalid_value") from None
        if not ids:
            raise APIError(400, f"{param}: the prompt encodes to no tokens", param=param, code="invalid_value")
        ctx = self.session.target.max_context
        if len(ids) >= ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context is {ctx}; shorten it",
                           param=param, code="context_length_exceeded")
        return ids

    def job(self, req: ChatCompletionRequest | CompletionRequest, ids: list[int], sink) -> Job:
        cfg = self.session.cfg  # the server's flags are the defaults of every request ...
        return Job(ids=ids, max_tokens=req.limit or cfg.max_new_tokens,
                   temperature=cfg.temperature if req.temperature is None else req.temperature,
                   top_p=cfg.top_p if req.top_p is None else req.top_p,
                   # ... but the seed: without one, two equal sampled requests should differ, as on OpenAI
                   seed=secrets.randbits(31) if req.seed is None else req.seed,
                   stops=req.stops, stream=req.stream, sink=sink)

    async def handle(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:  # from the worker thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
            req = parse(ChatCompletionRequest if chat else CompletionRequest, body)
            self.check_model(req.model)
            job = self.job(req, self.encode(req), sink)
            self.worker.submit(job)
        except APIError as e:
            self.metrics.request(endpoint, e.status)
            return error_response(e)
        shape = Shape(chat, req.model)
        if req.stream:
            return _JobStream(job, self.sse(job, events, shape, req.include_usage, endpoint),
                              media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.whole(request, job, events, shape, endpoint)

    async def whole(self, request: Request, job: Job, events: asyncio.Queue, shape: Shape, endpoint: str) -> Response:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=self.settings.disconnect_poll_s)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    self.metrics.request(endpoint, CLIENT_GONE)
                    return Response(status_code=CLIENT_GONE)
                continue
            except asyncio.CancelledError:
                job.cancel.set()
                self.metrics.request(endpoint, CLIENT_GONE)
                raise
            if isinstance(ev, Done):
                self.metrics.request(endpoint, 200)
                return JSONResponse(shape.whole(ev.text, ev.finish, usage(ev.prompt_tokens, ev.completion_tokens),
                                                speculative(self.session.cfg.method, ev.stats)))
            if isinstance(ev, Failed):
                self.metrics.request(endpoint, ev.error.status)
                return error_response(ev.error)

    async def sse(self, job: Job, events: asyncio.Queue, shape: Shape, include_usage: bool,
                  endpoint: str) -> AsyncIterator[str]:
        status = CLIENT_GONE  # until the stream ends on its own
        try:
            if shape.chat:
                yield _sse(shape.chunk("", first=True))
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    yield _sse(shape.chunk(ev.text))
                elif isinstance(ev, Done):
                    spec = speculative(self.session.cfg.method, ev.stats)
                    use = usage(ev.prompt_tokens, ev.completion_tokens)
                    yield _sse({**shape.chunk(None, finish=ev.finish), "speculative": spec})
                    if include_usage:
                        yield _sse(shape.usage_chunk(use, spec))
                    yield "data: [DONE]\n\n"
                    status = 200
                    return
                elif isinstance(ev, Failed):  # headers are sent: the error travels as an event
                    status = ev.error.status
                    yield _sse(ev.error.body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if status == CLIENT_GONE:
                job.cancel.set()
            self.metrics.request(endpoint, status)


class _JobStream(StreamingResponse):
    """A stream that cancels its job however it ends: a client gone before the first event never
    runs the generator's own ``finally``. After a finished job the cancel is a no-op."""

    def __init__(self, job: Job, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        try:
            yield
        finally:  # uvicorn has finished (or cancelled) in-flight requests by now
            await asyncio.to_thread(service.worker.close)
            if service.session.adapter is not None:
                service.session.adapter.close()

    app = FastAPI(title="SpecBlock", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.handle(request, chat=False)

    def _model() -> dict:
        return {"id": service.settings.model_name, "object": "model", "created": service.started,
                "owned_by": "specblock"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        try:
            service.check_model(name)
        except APIError as e:
            return error_response(e)
        return JSONResponse(_model())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": service.settings.model_name, "method": service.session.cfg.method,
                "queue_depth": service.worker.waiting}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    return app
