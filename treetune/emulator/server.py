"""SGLang's HTTP API, served by aiohttp on top of the emulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import sys
import time
import traceback
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import numpy as np
from aiohttp import ClientConnectionResetError, web

from treetune.backends._base import parse_version
from treetune.backends.emulator import CLOCK_LAG_INFO_KEY, EMULATOR_INFO_KEY
from treetune.backends.sglang import (
    ADAPTIVE_INFO_KEY,
    ADAPTIVE_STEPS_KEY,
    INTERNAL_STATES_KEY,
)
from treetune.config import TreeConfig
from treetune.datasets import CHAT_MESSAGE_TOKENS, text_tokens
from treetune.emulator.args import EmulatorSettings
from treetune.emulator.engine import Engine, Request
from treetune.emulator.metrics import VERIFY_COUNTER_SINCE, ServerMetrics
from treetune.perfmodel import NoiseModel, PerfModel, Profile

DATASET_HEADER = "X-Treetune-Dataset"
CRASH_EXIT_CODE = 70
WORDS = (
    "the model verifies a tree of draft tokens and keeps the longest accepted path plus one "
    "bonus token so that output matches plain decoding at temperature zero while the draft "
    "head proposes candidates from hidden states of the target"
).split(" ")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def token_text(seed: int, start: int, end: int) -> str:
    return "".join(" " + WORDS[(seed + 7919 * i) % len(WORDS)] for i in range(start, end))


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A request refused before its answer started, in SGLang's shape: the OpenAI
    endpoints' error object (`{"object": "error", "message", "type", "param", "code"}`, as
    `OpenAIServingBase.create_error_response` writes it) and `/generate`'s
    `{"error": {"message"}}`; the other endpoints answer in plain text, as SGLang's do,
    and so does a path or method no route serves."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        routed = exc.status not in (404, 405)
        if exc.status < 400 or not routed or not (request.path.startswith("/v1/")
                                                  or request.path == "/generate"):
            raise
        message = exc.text or exc.reason
        if request.path == "/generate":
            return web.json_response({"error": {"message": message}}, status=exc.status)
        kind = ("BadRequestError" if exc.status == 400
                else HTTPStatus(exc.status).phrase.title().replace(" ", "") + "Error")
        return web.json_response({"object": "error", "message": message, "type": kind,
                                  "param": None, "code": exc.status}, status=exc.status)


class EmulatedServer:
    def __init__(self, settings: EmulatorSettings, profile: Profile,
                 model: PerfModel | None = None, running: int | None = None) -> None:
        """`running`: how many requests the KV pool lets run at once, when fewer than
        --max-running-requests (the rest wait, as SGLang admits and retracts them)."""
        self.settings = settings
        self.profile = profile
        self.ready = False
        self.arrivals = 0
        self.started = time.time()
        rng = np.random.default_rng(settings.seed)
        self.metrics = ServerMetrics(
            settings.served_model_name,
            parse_version(settings.sglang_version) >= VERIFY_COUNTER_SINCE)
        adaptive = settings.adaptive
        self.engine = Engine(
            profile,
            settings.config,
            tp=settings.tp,
            max_running_requests=running or settings.max_running_requests,
            time_scale=settings.time_scale,
            noise=NoiseModel.from_profile(profile.noise, settings.noise),
            rng=rng,
            metrics=self.metrics,
            model=model or PerfModel(profile, settings.tp, method=settings.method),
            schedule=adaptive.schedule(settings.decode_graph_sizes) if adaptive else None,
            log=log,
            pool_limited=running is not None and running < settings.max_running_requests,
        )
        self.app = web.Application(middlewares=[self._auth, _json_errors])
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
            web.get("/get_model_info", self.model_info),
            web.get("/v1/models", self.models),
            web.post("/flush_cache", self.flush_cache),
            web.get("/flush_cache", self.flush_cache),
            web.get("/metrics", self.prometheus),
            web.post("/generate", self.generate),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ])
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle --------------------------------------------------------------------
    async def _start(self, app: web.Application) -> None:
        engine = asyncio.create_task(self.engine.run())
        engine.add_done_callback(_engine_ended)
        self._tasks += [engine, asyncio.create_task(self._load())]

    async def _stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()

    async def _load(self) -> None:
        s = self.settings
        if s.hang_on_startup:
            log("fault switch --hang-on-startup: loading never finishes")
            return
        if s.fail_on_startup:
            await asyncio.sleep(s.load_time / s.time_scale / 2)
            log("fault switch --fail-on-startup: failing while loading")
            print("RuntimeError: NCCL error: unhandled system error (emulated start-up "
                  "failure)", file=sys.stderr, flush=True)
            os._exit(1)
        await asyncio.sleep(s.load_time / s.time_scale)
        self.ready = True
        log("The server is fired up and ready to roll!")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.settings.api_key
        open_paths = ("/health", "/health_generate", "/metrics")
        authorized = hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {key}".encode())
        if key and request.path not in open_paths and not authorized:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # ---- info endpoints ---------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503, text="Server is loading")
        return web.Response(text="")

    def server_args(self) -> dict[str, Any]:
        """The resolved launch arguments, as SGLang logs them at start-up and returns them
        from /server_info: secrets included, as SGLang does (treetune must not keep them)."""
        s = self.settings
        return {
            **s.raw_args,
            "model_path": s.model_path,
            "served_model_name": s.served_model_name,
            "tp_size": s.tp,
            "host": s.host,
            "port": s.port,
            **s.speculative,
            "speculative_draft_model_path": s.draft_model_path,
            # Set back to False when SGLang falls back to static trees.
            ADAPTIVE_INFO_KEY: s.adaptive is not None,
            "max_running_requests": s.max_running_requests,
            "attention_backend": s.attention_backend,
            "mem_fraction_static": s.mem_fraction_static or self.profile.server.mem_fraction_static,
            "enable_metrics": s.enable_metrics,
            "api_key": s.api_key,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.settings
        args = self.server_args()
        state: dict[str, Any] = {"last_gen_throughput": self.engine.last_gen_throughput}
        if isinstance(s.config, TreeConfig):
            state["avg_spec_accept_length"] = self.engine.avg_accept_length
        if self.engine.schedule is not None:
            state[ADAPTIVE_STEPS_KEY] = self.engine.schedule.current()
        return web.json_response({
            **args,
            "version": s.sglang_version,
            INTERNAL_STATES_KEY: [state],
            EMULATOR_INFO_KEY: {
                "profile": self.profile.name,
                "method": s.method,
                "time_scale": s.time_scale,
                "completion_tokens": self.engine.completion_tokens,
                "verify_calls": self.engine.verify_calls,
                CLOCK_LAG_INFO_KEY: self.engine.lag.summary(),
            },
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.settings.model_path,
                                  "is_generation": True})

    async def models(self, request: web.Request) -> web.Response:
        name = self.settings.served_model_name
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(self.started), "owned_by": "sglang",
             "root": name}]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.engine.idle:
            return web.Response(status=400, text="Cache not flushed: there are running requests.")
        self.engine.flush()
        return web.Response(text="Cache flushed.\n")

    async def prometheus(self, request: web.Request) -> web.Response:
        if not self.settings.enable_metrics:
            return web.Response(status=404, text="metrics are off: start with --enable-metrics")
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---- generation -------------------------------------------------------------------
    async def _read(self, request: web.Request) -> tuple[dict[str, Any], str]:
        if not self.ready:
            raise web.HTTPServiceUnavailable(text="Server is loading")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise web.HTTPBadRequest(text="request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="request body must be a JSON object")
        dataset = request.headers.get(DATASET_HEADER) or next(iter(self.profile.datasets))
        if dataset not in self.profile.datasets:
            raise web.HTTPBadRequest(
                text=f"{DATASET_HEADER}: profile '{self.profile.name}' has no dataset "
                f"'{dataset}'; it knows {', '.join(self.profile.datasets)}")
        self.arrivals += 1
        limit = self.settings.crash_after_requests
        if limit is not None and self.arrivals > limit:
            log(f"fault switch --crash-after-requests {limit}: crashing now")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
        return body, dataset

    def _submit(self, dataset: str, prompt_tokens: int, max_new: Any, ignore_eos: Any) -> Request:
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
            raise web.HTTPBadRequest(
                text=f"max_new_tokens must be an integer >= 0, got {max_new!r}")
        prompt_tokens, max_new = self._within_context(prompt_tokens, max_new)
        return self.engine.new_request(dataset, prompt_tokens, max_new, bool(ignore_eos))

    def _within_context(self, prompt_tokens: int, max_new: int) -> tuple[int, int]:
        """A request against --context-length, as SGLang's tokenizer manager takes it
        (`_validate_one_request`): refused with its message, or cut with
        --allow-auto-truncate."""
        limit, cut = self.settings.context_length, self.settings.allow_auto_truncate
        if limit is None:
            return prompt_tokens, max_new
        if prompt_tokens >= limit:
            if not cut:
                raise web.HTTPBadRequest(text=(
                    f"The input ({prompt_tokens} tokens) is longer than the model's context "
                    f"length ({limit} tokens)."))
            prompt_tokens = limit
        if prompt_tokens + max_new > limit:
            if not cut:
                raise web.HTTPBadRequest(text=(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{limit} tokens. You requested a total of {prompt_tokens + max_new} "
                    f"tokens: {prompt_tokens} tokens from the input messages and {max_new} "
                    "tokens for the completion. Please reduce the number of tokens in the "
                    "input messages or the completion to fit within the limit."))
            max_new = max(0, limit - prompt_tokens)
        return prompt_tokens, max_new

    @contextlib.asynccontextmanager
    async def _client_may_leave(self, req: Request) -> AsyncIterator[None]:
        """A streaming client that disconnects, mid-stream or before the headers went out,
        ends its request quietly and aborts it, as in SGLang. Its headers were sent
        outside this, and a client gone by then made the handler raise: aiohttp logged a
        traceback in the server's log (a helper's audit)."""
        try:
            with contextlib.suppress(ConnectionResetError, ClientConnectionResetError):
                yield
        finally:
            if req.finished_at is None:
                self.engine.cancel(req)

    async def _tokens(self, req: Request) -> AsyncIterator[int]:
        """Yield the running token count after each round until the request ends.

        Rounds that completed while the handler was busy are coalesced into the newest
        count (as SGLang's tokenizer manager does), so that every yielded count equals
        `req.generated` and `req.done` at that moment: a chunk's text, meta_info and
        finish_reason always describe the same state.
        """
        try:
            while True:
                count = await req.updates.get()
                while count >= 0 and not req.updates.empty():
                    newer = req.updates.get_nowait()
                    if newer < 0:
                        yield count  # the final count, then end of stream
                        return
                    count = newer
                if count < 0:
                    return
                yield count
        finally:
            if req.finished_at is None:
                self.engine.cancel(req)

    async def _until_done(self, request: web.Request, req: Request) -> None:
        """A non-streaming request's rounds until it ends. A client that has gone aborts
        it, as SGLang's tokenizer manager does when it finds the connection closed: its
        slot is not held for an answer no one reads."""
        async with contextlib.aclosing(self._tokens(req)) as tokens:
            async for _ in tokens:
                if request.transport is None or request.transport.is_closing():
                    return  # closing `tokens` cancels the request

    def _meta(self, req: Request, seed: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.generated,
            "finish_reason": (None if not req.done
                              else {"type": "length", "length": req.max_new_tokens}
                              if req.generated >= req.max_new_tokens
                              else {"type": "stop", "matched": None}),
            "e2e_latency": ((req.finished_at or self.engine.clock) - req.arrival),
        }
        if self.engine.speculative:
            meta["spec_verify_ct"] = req.verify_ct
            meta["spec_accept_length"] = req.generated / req.verify_ct if req.verify_ct else 0.0
        return meta

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body, dataset = await self._read(request)
        text = body.get("text")
        if isinstance(text, list):
            raise web.HTTPBadRequest(text="batched /generate is not emulated; send one text")
        ids = body.get("input_ids")
        if text is None and ids is None:
            raise web.HTTPBadRequest(text="/generate needs 'text' or 'input_ids'")
        if ids is not None and not _token_ids(ids):
            raise web.HTTPBadRequest(text="input_ids must be a list of token ids (integers)")
        prompt_tokens = len(ids) if isinstance(ids, list) else text_tokens(str(text))
        params = _mapping(body, "sampling_params")
        req = self._submit(dataset, prompt_tokens, params.get("max_new_tokens", 128),
                           params.get("ignore_eos", False))
        seed = zlib.crc32(str(text if text is not None else ids).encode()) & 0xFFFF
        if not body.get("stream"):
            await self._until_done(request, req)
            return web.json_response({"text": token_text(seed, 0, req.generated),
                                      "meta_info": self._meta(req, seed)})
        response = _event_stream()
        async with self._client_may_leave(req), contextlib.aclosing(self._tokens(req)) as tokens:
            await response.prepare(request)
            async for count in tokens:
                chunk = {"text": token_text(seed, 0, count), "meta_info": self._meta(req, seed)}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, dataset = await self._read(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and not _token_ids(prompt):  # token ids are one prompt
            if len(prompt) != 1:
                raise web.HTTPBadRequest(text="one prompt per request in the emulator")
            prompt = prompt[0]
        if prompt is None:
            raise web.HTTPBadRequest(text="/v1/completions needs 'prompt'")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else text_tokens(str(prompt))
        return await self._openai(request, body, dataset, prompt_tokens, str(prompt),
                                  chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, dataset = await self._read(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise web.HTTPBadRequest(text="/v1/chat/completions needs a non-empty 'messages'")
        text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        prompt_tokens = text_tokens(text) + CHAT_MESSAGE_TOKENS * len(messages)
        return await self._openai(request, body, dataset, prompt_tokens, text, chat=True)

    async def _openai(self, request: web.Request, body: dict[str, Any], dataset: str,
                      prompt_tokens: int, prompt: str, *, chat: bool) -> web.StreamResponse:
        # 0 is a limit too: only an absent (or null) one takes the default.
        max_new = next((body[k] for k in ("max_completion_tokens", "max_tokens")
                        if body.get(k) is not None), 16)
        options = _mapping(body, "stream_options")  # checked before any byte is sent
        if body.get("n") not in (None, 1):  # refused rather than answered with one choice
            raise web.HTTPBadRequest(text=f"n={body['n']!r} is not emulated: one choice per "
                                     "request (send n requests)")
        req = self._submit(dataset, prompt_tokens, max_new, body.get("ignore_eos", False))
        seed = zlib.crc32(prompt.encode()) & 0xFFFF
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        kind = "chat.completion" if chat else "text_completion"
        model = body.get("model") or self.settings.served_model_name
        created = int(time.time())

        def usage() -> dict[str, int]:
            return {"prompt_tokens": req.prompt_tokens, "completion_tokens": req.generated,
                    "total_tokens": req.prompt_tokens + req.generated}

        def finish() -> str:
            return "length" if req.generated >= req.max_new_tokens else "stop"

        if not body.get("stream"):
            await self._until_done(request, req)
            text = token_text(seed, 0, req.generated)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish(), "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat
                          else {"text": text})
            return web.json_response({"id": rid, "object": kind, "created": created,
                                      "model": model, "choices": [choice], "usage": usage()})
        response = _event_stream()
        sent = 0
        role = {"role": "assistant"}  # in the first chunk's delta only, as SGLang sends it
        object_name = f"{kind}.chunk" if chat else kind
        async with self._client_may_leave(req), contextlib.aclosing(self._tokens(req)) as tokens:
            await response.prepare(request)
            async for count in tokens:
                delta = token_text(seed, sent, count)
                sent = count
                choice = {"index": 0, "finish_reason": finish() if req.done else None,
                          "logprobs": None}
                choice.update({"delta": {**role, "content": delta}} if chat
                              else {"text": delta})
                role = {}
                chunk = {"id": rid, "object": object_name, "created": created, "model": model,
                         "choices": [choice]}
                if options.get("continuous_usage_stats"):
                    chunk["usage"] = usage()
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if options.get("include_usage"):
                chunk = {"id": rid, "object": object_name, "created": created, "model": model,
                         "choices": [], "usage": usage()}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        return response


def _mapping(body: dict[str, Any], key: str) -> dict[str, Any]:
    """An optional object field of a request, as SGLang validates it (400 otherwise)."""
    value = body.get(key) or {}
    if not isinstance(value, dict):
        raise web.HTTPBadRequest(text=f"'{key}' must be a JSON object, got {value!r}")
    return value


def _token_ids(value: Any) -> bool:
    """Whether `value` is a prompt of token ids: a non-empty list of integers."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _event_stream() -> web.StreamResponse:
    """A streaming answer's response, not yet prepared (its headers unsent)."""
    return web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {message}", file=sys.stderr, flush=True)


def _engine_ended(task: asyncio.Task[None]) -> None:
    """The engine's loop ended on an error: the server exits with its traceback, as
    SGLang's does when its scheduler fails. Left up, it answered nothing for good, and a
    study waited on its requests until their timeouts."""
    if task.cancelled() or (exc := task.exception()) is None:
        return
    log("the engine failed: the server exits")
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)
