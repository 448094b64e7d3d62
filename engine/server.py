"""``dayzero serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the serving engine.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
streamable as server-sent events), ``GET /health``, ``GET /metrics`` (Prometheus). Chat messages
may carry images as ``image_url`` parts with data URLs (multimodal models; the server fetches
nothing): they are decoded off the event loop and travel with the request to ``submit``.

One thread, the step loop (``dayzero.engine.server_loop``), owns the ``ServingEngine``; each
HTTP request becomes ``n`` engine requests (one per choice, seeds ``seed``, ``seed + 1``, ...; a
request without a seed draws a random base) whose updates reach the handler through an asyncio
queue. A client that goes away cancels its engine requests; more outstanding requests than
``slots + max_queue`` answer 429 with ``Retry-After``; SIGINT/SIGTERM stop admitting (503), let
running requests finish for up to ``shutdown_timeout`` seconds, cancel the rest and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import sys
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dayzero.engine.generate import GenerationError
from dayzero.engine.sampling import SamplingError, SamplingParams
from dayzero.engine.server_loop import StepLoop, Submission, Update
from dayzero.engine.server_metrics import CONTENT_TYPE, ServerMetrics
from dayzero.engine.server_protocol import APIError, ChatRequest, CompletionRequest, validation_error
from dayzero.engine.server_responses import Shaper, sse, usage
from dayzero.engine.tokenizer import TokenizerError

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the context)


@dataclasses.dataclass
class ServerOptions:
    """What the HTTP layer needs to know beyond the engine."""

    model_name: str
    max_queue: int = 64
    retry_after_s: int = 1
    grammars: Any = None  # a dayzero.engine.grammar.Grammars, or None (no structured output)
    on_ready: Any = None  # called once the step loop runs (``dayzero serve`` announces its URL)


class _Server:
    """The state behind the routes: the engine's loop, metrics, options."""

    def __init__(self, serving, options: ServerOptions):
        self.serving = serving
        self.engine = serving.engine
        self.tokenizer = self.engine.tokenizer
        self.options = options
        self.max_context = serving.config.max_context
        self.metrics = ServerMetrics(lambda: self.loop.snapshot())
        slots = serving.config.slots * len(serving.replicas)  # every data replica has its own slots
        self.loop = StepLoop(serving, self.tokenizer, self.metrics, slots + options.max_queue)
        self.draining = False

    # ---- request -> submissions -----------------------------------------------------------------

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model's."""
        if name != self.options.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.options.model_name!r}",
                           type="NotFoundError", param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt as checked token ids (400 naming what is wrong)."""
        try:
            ids = self.engine.prompt_ids(prompt, chat=False)
        except (GenerationError, TokenizerError) as e:
            raise APIError(400, str(e), param="prompt") from None
        return self._fits(ids, "prompt")

    def chat_ids(self, body: ChatRequest) -> tuple[list[int], list[str]]:
        """The conversation through the model's chat template, as token ids (one placeholder per
        image, where the template writes it), and the data URLs of its images in order."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
        urls = [url for m in body.messages for url in m.image_urls()]
        if urls and (self.engine.config.vision is None or self.engine.weights.vision is None):
            raise APIError(400, f"this model has no vision tower, so it takes no images ({len(urls)} sent); send text "
                                "only, or serve a multimodal model (Qwen3-VL, Qwen3.5, Kimi-K2.5)", param="messages")
        messages = [{"role": m.role, "content": m.template_content()} for m in body.messages]
        try:
            ids = self.tokenizer.encode_messages(messages)
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from None
        return (self._fits(ids, "messages") if not urls else ids), urls

    def load_images(self, ids: list[int], urls: list[str]) -> tuple[list, int]:
        """The images of a chat request decoded (a worker thread runs this: decoding takes a
        while), and the tokens they add to the prompt beyond their placeholders; 400 naming an
        unreadable image, or the image that overflows the context."""
        from dayzero.engine import vision_step
        from dayzero.engine.image_processing import num_image_tokens
        from dayzero.engine.images import ImageError, load_image

        config = self.engine.image_config or vision_step.image_config_of(self.engine.config)
        images, added = [], 0
        for i, url in enumerate(urls):
            try:
                image = load_image(url)
                added += num_image_tokens(image.height, image.width, config) - 1  # its placeholder is counted
            except ImageError as e:
                raise APIError(400, f"image {i + 1} of {len(urls)}: {e}", param="messages") from None
            images.append(image)
            if len(ids) + added >= self.max_context:  # refused before decoding the rest
                raise APIError(400, f"the prompt has {len(ids) + added} tokens with its first {i + 1} of {len(urls)} "
                                    f"images, which leaves no room in this server's context of {self.max_context} "
                                    "tokens; send fewer or smaller images", param="messages",
                               code="context_length_exceeded")
        return images, added

    def _fits(self, ids: list[int], param: str) -> list[int]:
        if len(ids) >= self.max_context:
            raise APIError(400, f"the prompt has {len(ids)} tokens, which leaves no room in this server's context "
                                f"of {self.max_context} tokens; shorten it", param=param,
                           code="context_length_exceeded")
        return ids

    def submissions(self, body, prompts: list[list[int]], max_tokens: int | None, sink, images: list | None = None,
                    image_tokens: int = 0) -> list[Submission]:
        """One submission per prompt and choice, indexed prompt-major as OpenAI numbers choices.
        ``images``: those of the (one) prompt, which take ``image_tokens`` more than their
        placeholders."""
        body.check_supported()
        base = body.seed if body.seed is not None else random.getrandbits(32)
        top = (body.top_logprobs or 0) if isinstance(body, ChatRequest) else (body.logprobs or 0)
        subs = []
        for p, ids in enumerate(prompts):
            room = self.max_context - len(ids) - image_tokens
            default = room if isinstance(body, ChatRequest) else min(COMPLETION_MAX_TOKENS, room)
            for i in range(body.n):
                try:
                    params = SamplingParams(body.temperature, max(body.top_k, 0), body.top_p, body.min_p,
                                            (base + i) % 2**32)
                except SamplingError as e:
                    raise APIError(400, str(e)) from None
                subs.append(Submission(p * body.n + i, ids, max_tokens or default, params, sink,
                                       stops=body.stop_strings(), ignore_eos=body.ignore_eos, top_logprobs=top,
                                       constraint=self._constraint(body), images=images))
        return subs

    def _constraint(self, body):
        if body.response_format is None or body.response_format.type == "text":
            return None
        if self.options.grammars is None:
            raise APIError(400, "structured output needs a tokenizer, which this model lacks", param="response_format")
        return self.options.grammars.constraint(body.response_format)

    # ---- running them ---------------------------------------------------------------------------

    async def start(self, subs: list[Submission], queue: asyncio.Queue) -> None:
        """Hand ``subs`` to the engine; returns once all are queued there (else raises the 400 or
        429 that stops them, having cancelled the rest)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", type="server_error")
        if not self.loop.reserve(len(subs)):
            self.metrics.requests.labels("rejected").inc(len(subs))
            raise APIError(429, f"the request queue is full ({self.options.max_queue} waiting); retry shortly",
                           type="rate_limit_error", headers={"Retry-After": str(self.options.retry_after_s)})
        for sub in subs:
            self.loop.submit(sub)
        pending, early = len(subs), []
        try:
            while pending:
                update: Update = await queue.get()
                if update.error is not None:
                    raise APIError(400, update.error)
                if update.accepted:
                    pending -= 1
                else:
                    early.append(update)  # a fast choice's first tokens can come before the others are queued
        except BaseException:  # refused, or the client went away meanwhile
            self.cancel(subs)
            raise
        for update in early:
            queue.put_nowait(update)

    def cancel(self, subs: list[Submission]) -> None:
        """Withdraw ``subs`` from the engine (those not already cancelled)."""
        for sub in subs:
            if not sub.cancelled:
                self.loop.cancel(sub)


def _sink(queue: asyncio.Queue):
    """A thread-safe callback that puts updates into ``queue`` (on the running event loop)."""
    loop = asyncio.get_running_loop()

    def sink(update: Update) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, update)

    return sink


async def _handle(server: _Server, request: Request, body, prompts: list[list[int]], max_tokens: int | None, chat: bool,
                  images: list | None = None, image_tokens: int = 0):
    queue: asyncio.Queue = asyncio.Queue()
    subs = server.submissions(body, prompts, max_tokens, _sink(queue), images, image_tokens)
    logprobs = body.logprobs if chat else body.logprobs is not None
    shaper = Shaper(chat, server.options.model_name, server.tokenizer, bool(logprobs), body.return_token_ids)
    await server.start(subs, queue)
    prompt_tokens = sum(len(p) for p in prompts) + image_tokens  # as the model sees them: images expanded
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(server, subs, queue, shaper, prompt_tokens, include_usage),
                                 media_type="text/event-stream")
    return await _collect(server, request, subs, queue, shaper, prompt_tokens)


async def _stream(server: _Server, subs, queue, shaper: Shaper, prompt_tokens: int, include_usage: bool
                  ) -> AsyncIterator[str]:
    sent = {s.index: 0 for s in subs}  # characters sent per choice
    started: set[int] = set()
    done: set[int] = set()
    generated = 0
    try:
        while len(done) < len(subs):
            update: Update = await queue.get()
            if update.error is not None:
                yield sse({"error": APIError(500, update.error, type="server_error").body()["error"]})
                done.add(update.index)
                continue
            generated += len(update.tokens)
            yield sse(shaper.chunk(update, update.index not in started, sent[update.index]))
            started.add(update.index)
            sent[update.index] += len(update.text)
            if update.finish_reason is not None:
                done.add(update.index)
        if include_usage:
            yield sse(shaper.usage_chunk(usage(prompt_tokens, generated)))
        yield sse("[DONE]")
    finally:  # the client went away (the generator is closed or cancelled): free the engine's rows
        server.cancel([s for s in subs if s.index not in done])


async def _collect(server: _Server, request: Request, subs, queue, shaper: Shaper, prompt_tokens: int):
    choices = {s.index: {"index": s.index, "text": "", "tokens": [], "finish_reason": None} for s in subs}
    open_ = len(subs)
    try:
        while open_:
            try:
                update: Update = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if update.error is not None:
                raise APIError(500, update.error, type="server_error")
            c = choices[update.index]
            c["text"] += update.text
            c["tokens"] += update.tokens
            if update.finish_reason is not None:
                c["finish_reason"] = update.finish_reason
                open_ -= 1
    finally:
        server.cancel([s for s in subs if choices[s.index]["finish_reason"] is None])
    generated = sum(len(c["tokens"]) for c in choices.values())
    return JSONResponse(shaper.full([choices[i] for i in sorted(choices)], usage(prompt_tokens, generated)))


def create_app(serving, options: ServerOptions) -> FastAPI:
    """The FastAPI application over ``serving`` (a ``ServingEngine``, compiled or not); its
    lifespan starts and stops the step loop."""
    server = _Server(serving, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        """The step loop runs while the app does."""
        server.loop.start()
        if options.on_ready is not None:
            options.on_ready()
        yield
        server.draining = True
        server.loop.stop()

    app = FastAPI(title="dayzero", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError):
        """An :class:`APIError` as its OpenAI error object."""
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, e: RequestValidationError):
        """Malformed JSON and wrong fields: 400 (FastAPI's default is 422), OpenAI-shaped."""
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=400)

    @app.get("/health")
    async def health():
        """200 while serving; 503 once shutting down or if the step loop died."""
        if not server.loop.alive or server.draining:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        """Prometheus text format."""
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        """The one served model."""
        card = {"id": options.model_name, "object": "model", "created": 0, "owned_by": "dayzero",
                "max_model_len": server.max_context}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI legacy completions (text or token-id prompts, or a batch of them)."""
        server.check_model(body.model)
        prompts = [server.prompt_ids(p) for p in body.prompts()]
        return await _handle(server, request, body, prompts, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        """OpenAI chat completions through the model's chat template."""
        server.check_model(body.model)
        ids, urls = server.chat_ids(body)
        images, added = (await asyncio.to_thread(server.load_images, ids, urls)) if urls else (None, 0)
        return await _handle(server, request, body, [ids], body.requested_max_tokens(), chat=True, images=images,
                             image_tokens=added)

    return app


def announce(url: str, model_name: str) -> None:
    """The line that says the server is ready (tests and scripts wait for it)."""
    print(f"dayzero: serving {model_name} at {url}/v1 (Ctrl-C to stop)", flush=True)
    print(f"dayzero: ready {url}", file=sys.stderr, flush=True)
