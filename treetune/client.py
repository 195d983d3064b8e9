"""The one place that talks HTTP to a server (SGLang or the emulator).

`ServerClient` is async (aiohttp) for benchmarking; `health_status` is a blocking probe for
code that waits for a server to start.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from treetune.backends import AdaptiveState, ServerApi
from treetune.backends.emulator import EMULATOR_INFO_KEY
from treetune.backends.sglang import SGLANG_API
from treetune.errors import TreetuneError

if TYPE_CHECKING:
    from treetune.datasets import Prompt

DATASET_HEADER = "X-Treetune-Dataset"  # the emulator picks acceptance by it; SGLang ignores it
# Servers are reached directly, as aiohttp does (trust_env=False): never through *_proxy.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerRequestError(TreetuneError):
    """A request the server refused or could not answer."""

    def __init__(self, url: str, status: int | None, detail: str = "") -> None:
        what = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{url}: {what}{': ' + detail if detail else ''}")
        self.url = url
        self.status = status
        self.detail = detail


def health_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status of a GET on `url`, or None while nothing answers there."""
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class ServerClient:
    """An HTTP session with one server. Use `async with`, or call `aclose()`."""

    def __init__(self, base_url: str, api_key: str | None = None,
                 dataset: str | None = None, api: ServerApi = SGLANG_API) -> None:
        self.base_url = base_url.rstrip("/")
        self.dataset = dataset
        self.api = api  # the server's routes and metric names
        headers = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if dataset:
            headers[DATASET_HEADER] = dataset
        # No total timeout: a stream lasts as long as its generation; a silent server is
        # caught by the read timeout.
        timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=300)
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self._time_scale: float | None = None

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._session.close()

    # ---- info -------------------------------------------------------------------------
    async def health(self) -> bool:
        """Whether the server can generate (its health route answers 200)."""
        try:
            async with self._session.get(self.base_url + self.api.health) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def server_info(self) -> dict[str, Any]:
        """Resolved server args, version and internal states (the API's server-info route)."""
        *newer, oldest = self.api.server_info
        for route in newer:
            try:
                return await self._get_json(route)
            except ServerRequestError as exc:
                if exc.status != 404:
                    raise
        return await self._get_json(oldest)

    async def adaptive_state(self) -> AdaptiveState:
        """Whether the server runs adaptive steps, and each batch-size slot's steps now."""
        if self.api.adaptive_state is None:
            raise TreetuneError("this server's engine has no adaptive step controller")
        return self.api.adaptive_state(await self.server_info())

    async def time_scale(self) -> float:
        """How many times faster than real time the server runs: the emulator's
        `--time-scale`, 1 for SGLang. Wall seconds = server seconds / time_scale."""
        if self._time_scale is None:
            info = await self.server_info()
            emulator = info.get(EMULATOR_INFO_KEY) or {}
            self._time_scale = float(emulator.get("time_scale", 1.0))
        return self._time_scale

    async def metrics(self) -> dict[str, float]:
        """The Prometheus metrics as sample name -> value, summed over label sets."""
        url = self.base_url + self.api.metrics
        text = await self._text("GET", url, hint=" (was the server started with "
                                "--enable-metrics?)")
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    async def flush_cache(self) -> bool:
        """Reset the server's caches and cumulative accept length; False if it is busy."""
        url = self.base_url + self.api.flush_cache
        try:
            async with self._session.post(url) as response:
                await response.read()
                return response.status == 200
        except aiohttp.ClientError as exc:
            raise ServerRequestError(url, None, str(exc) or type(exc).__name__) from exc

    # ---- generation -------------------------------------------------------------------
    async def stream(self, prompt: Prompt, max_new_tokens: int, *,
                     ignore_eos: bool = False) -> AsyncIterator[tuple[float, int]]:
        """Stream one greedy completion of `prompt`; yields (time.monotonic() at arrival,
        completion tokens so far) for every chunk that brings tokens.

        Closing the iterator early closes the connection, which aborts the request
        server-side.
        """
        url = self.base_url + self.api.completions[prompt.api]
        body: dict[str, Any] = (
            {"messages": [dict(m) for m in prompt.messages]} if prompt.messages is not None
            else {"prompt": prompt.text}
        )
        body.update({
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "stream": True,
            # SGLang reports usage in every chunk with continuous_usage_stats.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        })
        if ignore_eos:
            body["ignore_eos"] = True  # an SGLang sampling parameter, accepted at top level
        tokens = 0
        done = False
        try:
            async with self._session.post(url, json=body) as response:
                if response.status != 200:
                    raise ServerRequestError(url, response.status, await _detail(response))
                try:
                    async for line in response.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        count = _completion_tokens(json.loads(data), url)
                        if count is not None and count > tokens:
                            tokens = count
                            yield time.monotonic(), tokens
                    done = True
                finally:
                    if not done:
                        response.close()  # abort: SGLang drops the request on disconnect
        except aiohttp.ClientError as exc:
            raise ServerRequestError(url, None, str(exc) or type(exc).__name__) from exc
        if tokens == 0 and max_new_tokens > 0:
            raise ServerRequestError(url, 200, "the stream reported no completion tokens; the "
                                     "server must support stream_options.continuous_usage_stats")

    # ---- plumbing ---------------------------------------------------------------------
    async def _get_json(self, path: str) -> dict[str, Any]:
        text = await self._text("GET", self.base_url + path)
        return json.loads(text)

    async def _text(self, method: str, url: str, hint: str = "") -> str:
        try:
            async with self._session.request(method, url) as response:
                if response.status != 200:
                    detail = await _detail(response)
                    if response.status == 404 and hint:
                        detail = f"{detail}{hint}"
                    raise ServerRequestError(url, response.status, detail)
                return await response.text()
        except aiohttp.ClientError as exc:
            raise ServerRequestError(url, None, str(exc) or type(exc).__name__) from exc


def _completion_tokens(chunk: Any, url: str) -> int | None:
    if isinstance(chunk, dict) and "error" in chunk:
        raise ServerRequestError(url, 200, f"error in stream: {_message(chunk['error'])}")
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    if not usage:
        return None
    return int(usage.get("completion_tokens") or 0)


def _message(error: Any) -> Any:
    """What an `error` field says: its `message` when it is an object, else itself."""
    return error.get("message", error) if isinstance(error, dict) else error


async def _detail(response: aiohttp.ClientResponse) -> str:
    """What a refused request's answer says: the message of SGLang's JSON errors (the
    OpenAI endpoints' `{"object": "error", "message": ...}`, `/generate`'s
    `{"error": {"message": ...}}`, FastAPI's `{"detail": ...}`), else the first line of
    its text."""
    text = (await response.text(errors="replace")).strip()
    with contextlib.suppress(ValueError, RecursionError):
        body = json.loads(text)
        if isinstance(body, dict):
            message = (body.get("message") or body.get("detail")
                       or _message(body.get("error")))
            if isinstance(message, str) and message.strip():
                text = message.strip()
    return text.splitlines()[0][:300] if text else (response.reason or "")
