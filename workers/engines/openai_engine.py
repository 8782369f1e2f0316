"""``openai``: any OpenAI-compatible server (``vllm serve``, SGLang, llama.cpp's server, TGI) as the engine.

The server batches and caches prefixes by itself; the worker decides what reaches it and when. A
claimed batch's items go as concurrent requests to their line's endpoint (``/v1/chat/completions``
with the messages rebuilt, or ``/v1/completions``: workers/engines/requests.py), so the server's
prefix cache sees one shape at a time, and the worker holds about one batch beyond what is in flight
(``room``), so that the backlog waits in Redis.

* In flight at most ``limit`` requests, which adapts as llm-d's batch processor does: halved on a
  429, a 5xx or a timeout (the request is sent again after a pause), grown on success: by one a
  success while the server's own ``/metrics`` says nothing waits in its queue (vLLM's
  ``vllm:num_requests_waiting``), by one a window of successes when it does not say, never while
  requests wait there (more in flight would only queue on the server).
* Health before work: the engine waits for ``/health`` (or ``/v1/models``) at start, checks that the
  server serves the model, and takes the input length from its ``max_model_len`` when it gives one.
* A server that goes away (a refused or dropped connection, confirmed by a failed health probe): the
  requests in flight are dropped, ``step`` raises ``EngineOutage`` (their batches go back to Redis,
  not answered as failed), and ``room`` stays 0 until the server answers its health probe again.
* A 4xx that is the request's own (a 400, 404, 413, 422) is that item's error; one about the context
  length is ``input_too_long``. A 5xx sent back more than ``MAX_RETRIES`` times is the item's error too.

Network I/O runs on one asyncio loop in a thread of its own; the worker's thread only hands requests
over (``admit``) and collects what finished (``step``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from conductor.redis_contract.records import Batch, BatchItem, Contract, ResultError

from .base import ContractHolder, EngineConfigError, EngineOutage, EngineUnavailable, Finished, too_long
from .requests import EngineRequest, request_of

log = logging.getLogger("conductor.engine.openai")

METRICS_MISSES = 3  # reads of /metrics in a row without the gauge before its value is forgotten
MAX_RETRIES = 4  # a 429, 5xx or timeout sent again this many times before it is the item's error
PROBE_S = 0.5  # health probes while the server is away
METRICS_S = 1.0  # the server's queue read this often
CONTEXT_WORDS = ("context length", "maximum context", "max_model_len", "too long", "maximum model length")
ITEM_STATUSES = (400, 404, 405, 413, 422)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as e:
        raise EngineUnavailable(f"engine openai needs httpx: pip install httpx ({e})") from None
    return httpx


def base_urls(endpoint: str) -> tuple[str, str]:
    """(the API base ending in /v1, the server root for /health and /metrics) of an endpoint URL."""
    base = endpoint.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise EngineConfigError(f"--endpoint: {endpoint!r} is not an http:// or https:// URL")
    if not base.endswith("/v1"):
        base += "/v1"
    return base, base[: -len("/v1")]


@dataclass
class OpenAICounters:
    sent: int = 0
    finished: int = 0
    retries: int = 0
    outages: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # in the item's own input_tokens, from the server's cached_tokens when it reports them
    limit: float = 0.0
    server_waiting: int = -1  # -1: the server does not say


@dataclass
class _Req:
    batch: Batch
    item: BatchItem
    req: EngineRequest
    tries: int = 0


class OpenAIEngine(ContractHolder):
    kind = "openai"
    streams_results = True  # each item's result is written as it finishes (workers/worker.py)

    def __init__(self, model: str, *, endpoint: str, api_key: str | None = None, served_model: str | None = None,
                 max_batch_size: int | None = None, max_batch_tokens: int | None = None,
                 max_input_len: int | None = None, max_in_flight: int | None = None,
                 request_timeout_s: float = 900.0, start_wait_s: float | None = None) -> None:
        httpx = _httpx()
        self.base, self.root = base_urls(endpoint)
        self.served = served_model or model
        size = max_batch_size or 64
        self.ceiling = max_in_flight or 2 * size
        self.counters = OpenAICounters(limit=float(min(self.ceiling, size)))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(request_timeout_s, connect=5.0)
        self._sync = httpx.Client(headers=headers, timeout=httpx.Timeout(5.0))
        server_len = self._wait_healthy(start_wait_s)
        limit_len = min(x for x in (max_input_len, server_len - 1 if server_len else None, 4096) if x)
        self._contract = Contract(model=model, max_batch_size=size,
                                  max_batch_tokens=max_batch_tokens or size * limit_len, max_input_len=limit_len)
        self._headers = headers
        self._done: queue.SimpleQueue[Finished | None] = queue.SimpleQueue()
        self._live = 0  # admitted and not yet collected by step (the worker's thread only)
        self._last_batch = size  # items in the last batch admitted: pacing's unit
        self._lost = 0  # dropped by an outage, not yet reported (the loop's thread writes, under _mu)
        self._mu = threading.Lock()
        self.down = False
        self._waiting: deque[_Req] = deque()  # the loop's thread only
        self._flying: set[asyncio.Task[None]] = set()
        self._ok_streak = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-engine", daemon=True)
        self._thread.start()
        self._client: Any = asyncio.run_coroutine_threadsafe(self._make_client(), self._loop).result()
        self._metrics_task = asyncio.run_coroutine_threadsafe(self._watch_queue(), self._loop)

    # ------------------------------------------------------------------ start
    def _wait_healthy(self, wait_s: float | None) -> int | None:
        """Block until the server answers; check it serves the model; its max_model_len if it says."""
        said, t0 = False, time.monotonic()
        while True:
            models = self._models()
            if models is not None:
                break
            if wait_s is not None and time.monotonic() - t0 > wait_s:
                raise EngineConfigError(f"--endpoint: no OpenAI-compatible server answers at {self.base} "
                                        f"(waited {wait_s:g} s)")
            if not said:
                log.warning("engine openai: waiting for the server at %s to answer", self.base)
                said = True
            time.sleep(PROBE_S)
        names = [str(m.get("id")) for m in models]
        if names and self.served not in names:
            raise EngineConfigError(f"--served-model: the server at {self.base} serves {', '.join(names)}, not "
                                    f"{self.served!r} (--served-model names the server's model, --model the "
                                    "conductor's)")
        mine = next((m for m in models if m.get("id") == self.served), {})
        n = mine.get("max_model_len")
        return int(n) if isinstance(n, int) and n > 1 else None

    def _models(self) -> list[dict[str, Any]] | None:
        """The server's model list, or None while it does not answer."""
        try:
            resp = self._sync.get(f"{self.base}/models")
        except _httpx().HTTPError:
            return None
        if resp.status_code in (401, 403):
            raise EngineConfigError(f"--api-key: the server at {self.base} refused it ({resp.status_code})")
        if resp.status_code != 200:
            return None
        try:
            data = resp.json().get("data", [])
        except ValueError:
            return None
        return [m for m in data if isinstance(m, dict)]

    async def _make_client(self) -> Any:
        httpx = _httpx()
        limits = httpx.Limits(max_connections=self.ceiling + 4, max_keepalive_connections=self.ceiling + 4)
        return httpx.AsyncClient(headers=self._headers, timeout=self._timeout, limits=limits)

    # ------------------------------------------------------------------ protocol
    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        limit = self._contract.max_input_len
        refused, reqs = [], []
        for it in items:
            if it.input_tokens > limit:
                refused.append(too_long(batch, it, limit))
            else:
                reqs.append(_Req(batch, it, request_of(batch, it)))
        if reqs:
            self._live += len(reqs)
            self._loop.call_soon_threadsafe(self._enqueue, reqs)
        self._last_batch = max(1, len(items))
        return refused

    def step(self) -> list[Finished]:
        if not self._live:
            return []
        done = self._drain(block_s=0.05)
        with self._mu:
            lost, self._lost = (self._lost, 0) if not done else (0, self._lost)
        if lost:
            self._live -= lost
            raise EngineOutage(f"openai: the server at {self.base} went away; {lost} requests dropped")
        return done

    def _drain(self, block_s: float) -> list[Finished]:
        out: list[Finished] = []
        try:
            got = self._done.get(timeout=block_s)
        except queue.Empty:
            return out
        while True:
            if got is not None:
                out.append(got)
            try:
                got = self._done.get_nowait()
            except queue.Empty:
                break
        self._live -= len(out)
        return out

    def active(self) -> int:
        return self._live

    def room(self) -> int:
        """Items to claim now: none while the server is away; a batch's worth once what is not yet sent
        (beyond the window in flight) is under half the last batch this engine got, else none."""
        if self.down:
            return 0
        unsent = self._live - min(self._live, int(self.counters.limit))
        return self._contract.max_batch_size if 2 * unsent < self._last_batch else 0

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """The server prepares itself; nothing to send ahead."""

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            self._waiting.clear()
            for t in list(self._flying):
                t.cancel()
            self._metrics_task.cancel()
            await self._client.aclose()
        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()
            self._sync.close()
        self._live = 0

    # ------------------------------------------------------------------ the loop's thread
    def _enqueue(self, reqs: list[_Req]) -> None:
        if self.down:
            self._drop(len(reqs))
            return
        self._waiting.extend(reqs)
        self._pump()

    def _pump(self) -> None:
        while self._waiting and not self.down and len(self._flying) < int(self.counters.limit):
            r = self._waiting.popleft()
            task = self._loop.create_task(self._send(r))
            self._flying.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._flying.discard(task)
        self._pump()

    def _drop(self, n: int) -> None:
        with self._mu:
            self._lost += n
        self._done.put(None)  # wakes a step blocked on the queue

    async def _send(self, r: _Req) -> None:
        try:
            await self._attempt(r)
        except asyncio.CancelledError:  # dropped by an outage, whichever await it was in
            self._drop(1)
            raise

    async def _attempt(self, r: _Req) -> None:
        httpx = _httpx()
        url = f"{self.base}/chat/completions" if r.req.messages is not None else f"{self.base}/completions"
        self.counters.sent += 1
        try:
            resp = await self._client.post(url, json=r.req.body(self.served))
        except httpx.TimeoutException:
            await self._again(r, "timeout")
            return
        except httpx.TransportError as e:
            await self._lost_connection(r, e)
            return
        if resp.status_code == 200:
            self._answered(r, resp)
        elif resp.status_code == 429 or resp.status_code >= 500:
            await self._again(r, f"HTTP {resp.status_code}", resp.text)
        else:
            self._item_error(r, resp)

    def _answered(self, r: _Req, resp: Any) -> None:
        try:
            body = resp.json()
            choice = body["choices"][0]
            text = choice["message"]["content"] if r.req.messages is not None else choice["text"]
            usage = body.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self._finish(r, "", 0, ResultError("bad_response", f"openai: the server's answer did not parse: {e!r}"))
            return
        n = int(usage.get("completion_tokens") or 0)
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        c = self.counters
        c.output_tokens += n
        c.prompt_tokens += prompt
        if prompt and cached:
            c.prefix_hit_tokens += min(r.item.input_tokens, r.item.input_tokens * cached // prompt)
        self._ok_streak += 1
        if c.limit < self.ceiling and c.server_waiting <= 0:
            step = 1.0 if c.server_waiting == 0 else 1.0 / max(1.0, c.limit)
            c.limit = min(float(self.ceiling), c.limit + step)
        self._finish(r, text or "", n, None)

    def _item_error(self, r: _Req, resp: Any) -> None:
        text = resp.text[:1500]
        code = "input_too_long" if any(w in text.lower() for w in CONTEXT_WORDS) else "bad_request"
        if resp.status_code not in ITEM_STATUSES:
            code = "server_refused"
        self._finish(r, "", 0, ResultError(code, f"openai: HTTP {resp.status_code} from the server: {text}"))

    def _finish(self, r: _Req, text: str, n: int, err: ResultError | None) -> None:
        self.counters.finished += 1
        self._done.put(Finished(r.batch, r.item, text, n, err))

    async def _again(self, r: _Req, why: str, text: str = "") -> None:
        """Congestion: halve the window and send ``r`` again after a pause (its item's error at the end)."""
        c = self.counters
        c.limit = max(1.0, c.limit / 2)
        r.tries += 1
        if r.tries > MAX_RETRIES:
            self._finish(r, "", 0, ResultError("server_error", f"openai: {why} {MAX_RETRIES + 1} times: {text[:1500]}"))
            return
        c.retries += 1
        await asyncio.sleep(min(8.0, 0.25 * 2 ** r.tries))
        if self.down:
            self._drop(1)
        else:
            self._waiting.appendleft(r)

    async def _lost_connection(self, r: _Req, err: BaseException) -> None:
        """A refused or dropped connection: a blip if the server still answers its health probe, an
        outage if not (everything in flight is dropped; their batches go back)."""
        if not self.down and await self._healthy():
            await self._again(r, f"connection error {err!r}")
            return
        self._drop(1)
        if self.down:
            return
        self.down = True
        self.counters.outages += 1
        log.warning("engine openai: the server at %s went away (%r): dropping what is in flight", self.base, err)
        dropped = len(self._waiting)
        self._waiting.clear()
        if dropped:
            self._drop(dropped)
        for t in list(self._flying):
            if t is not asyncio.current_task():
                t.cancel()
        self._loop.create_task(self._until_back())

    async def _healthy(self) -> bool:
        for path in (f"{self.root}/health", f"{self.base}/models"):
            try:
                resp = await self._client.get(path, timeout=2.0)
            except Exception:  # noqa: BLE001 - any transport failure: not healthy
                continue
            if resp.status_code == 200:
                return True
        return False

    async def _until_back(self) -> None:
        while not await self._healthy():
            await asyncio.sleep(PROBE_S)
        self.counters.limit = max(1.0, self.counters.limit / 2)
        self.down = False
        log.warning("engine openai: the server at %s answers again", self.base)

    async def _watch_queue(self) -> None:
        """The server's waiting requests from its /metrics, while it publishes vLLM's gauge."""
        missed = 0
        while True:
            try:
                resp = await self._client.get(f"{self.root}/metrics", timeout=2.0)
                waiting = _gauge(resp.text, "vllm:num_requests_waiting") if resp.status_code == 200 else None
            except Exception:  # noqa: BLE001 - a server down or without /metrics: nothing said
                waiting = None
            if waiting is None and self.counters.server_waiting == -1 and not self.down:
                return  # it does not publish the gauge: growth stays the slow kind
            # One slow or failed read of a server that publishes the gauge is not news: a busy
            # server answers /metrics late, and forgetting its queue would slow the window's growth
            # for nothing. Only a run of them (or an outage, said by the health probe) is.
            missed = missed + 1 if waiting is None else 0
            if waiting is not None or missed >= METRICS_MISSES:
                self.counters.server_waiting = -1 if waiting is None else waiting
            await asyncio.sleep(METRICS_S)


def _gauge(text: str, name: str) -> int | None:
    """The sum of a gauge's samples in Prometheus text, or None when absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except ValueError:
                continue
    return int(total) if seen else None
