"""Streaming clients for TGI's `/generate_stream` and OpenAI's `/v1/completions` (or chat), and the
load generator that drives them: closed-loop concurrency or Poisson arrivals.

Times are taken on the client as chunks arrive: TTFT is the first chunk with non-empty text, inter-token
latency the gaps between consecutive non-empty chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

import httpx

from pytgi.bench.workload import BenchRequest

PROTOCOLS = ("tgi", "openai")


# -- Server-Sent Events ----------------------------------------------------------------------------
class SSEParser:
    """Incremental Server-Sent Events parser: feed it lines, get each event's data when it completes.

    Comment lines (`:` keep-alives) and fields other than `data` are ignored; `data:` with or without the
    space; several data lines of one event are joined with newlines (the SSE spec)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if not sep:
            name, value = line, ""
        elif value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data

    def close(self) -> str | None:
        """The last event, should the stream end without its blank line."""
        return self._dispatch()


def iter_sse(lines: Iterable[str]) -> Iterator[str]:
    """The data of every event in a stream of lines."""
    parser = SSEParser()
    for line in lines:
        if (data := parser.feed(line)) is not None:
            yield data
    if (data := parser.close()) is not None:
        yield data


# -- protocols ---------------------------------------------------------------------------------------
@dataclass
class Chunk:
    """What one event means to the benchmark."""

    text: str = ""
    final: bool = False  # the server says the generation ended
    error: str | None = None
    reported_tokens: int | None = None  # the server's own count of generated tokens, when it sends one
    token_event: bool = False  # the event stands for one generated token (TGI)
    full_text: str | None = None  # the whole generated text, when the server sends it


def _json_object(data: str) -> dict[str, Any] | Chunk:
    """An event's JSON object, or an error chunk when it is not one."""
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    return obj if isinstance(obj, dict) else Chunk(error=f"bad event: {data[:200]}")


def _error_message(err: object) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err.get("error") or json.dumps(err))
    return str(err)


class _TGIOptions(TypedDict, total=False):
    ignore_eos_token: bool


class TGIParameters(_TGIOptions):
    max_new_tokens: int
    details: bool


class TGIBody(TypedDict):
    """`POST /generate_stream`'s request."""

    inputs: str
    parameters: TGIParameters


class _OpenAIOptions(TypedDict, total=False):
    messages: list[dict[str, str]]  # chat
    prompt: str  # completions
    ignore_eos: bool
    stream_options: dict[str, bool]


class OpenAIBody(_OpenAIOptions):
    """`POST /v1/completions`' (or `/v1/chat/completions`') request."""

    model: str
    stream: bool
    temperature: float
    max_tokens: int


class Protocol:
    name = ""
    path = ""
    # Time and count tokens by the server's token events (an empty text included), not by the text:
    # a random-weight model's tokens are often bytes of no whole character, or special tokens, which a
    # server streams as empty text (`pytgi bench --count-tokens events`).
    by_events = False

    def body(self, req: BenchRequest, ignore_eos: bool) -> TGIBody | OpenAIBody:
        raise NotImplementedError

    def parse(self, data: str) -> Chunk:
        raise NotImplementedError

    def needs_final(self) -> bool:
        return True


class TGIProtocol(Protocol):
    """`POST /generate_stream`: `data:{json}` per token; the last carries `generated_text`."""

    name = "tgi"
    path = "/generate_stream"

    def body(self, req: BenchRequest, ignore_eos: bool) -> TGIBody:
        params: TGIParameters = {"max_new_tokens": req.output_len, "details": False}
        if ignore_eos:
            params["ignore_eos_token"] = True
        return {"inputs": req.prompt, "parameters": params}

    def parse(self, data: str) -> Chunk:
        obj = _json_object(data)
        if isinstance(obj, Chunk):
            return obj
        if "error" in obj:
            kind = obj.get("error_type")
            return Chunk(error=_error_message(obj["error"]) + (f" ({kind})" if kind else ""), final=True)
        token = obj.get("token") or {}
        text = "" if token.get("special") else (token.get("text") or "")
        details = obj.get("details") or {}
        final = obj.get("generated_text") is not None
        return Chunk(
            text=text,
            final=final,
            token_event=bool(token),
            reported_tokens=details.get("generated_tokens"),
            full_text=obj.get("generated_text"),
        )


class OpenAIProtocol(Protocol):
    """`POST /v1/completions` (or `/v1/chat/completions`) with `stream: true`; ends with `data: [DONE]`."""

    name = "openai"

    def __init__(
        self,
        model: str = "default",
        chat: bool = False,
        send_ignore_eos: bool = True,
        include_usage: bool = True,
    ) -> None:
        self.model = model
        self.chat = chat
        self.send_ignore_eos = send_ignore_eos  # a vLLM / llama.cpp extension; some servers reject it
        self.include_usage = include_usage
        self.path = "/v1/chat/completions" if chat else "/v1/completions"

    def body(self, req: BenchRequest, ignore_eos: bool) -> OpenAIBody:
        body: OpenAIBody = {
            "model": self.model,
            "stream": True,
            "temperature": 0,
            "max_tokens": req.output_len,
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if ignore_eos and self.send_ignore_eos:
            body["ignore_eos"] = True
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    def parse(self, data: str) -> Chunk:
        if data.strip() == "[DONE]":
            return Chunk(final=True)
        obj = _json_object(data)
        if isinstance(obj, Chunk):
            return obj
        if obj.get("error") is not None:
            return Chunk(error=_error_message(obj["error"]), final=True)
        text, event = "", False
        for choice in obj.get("choices") or []:
            if self.chat or "delta" in choice:
                piece = (choice.get("delta") or {}).get("content") or ""
            else:
                piece = choice.get("text") or ""
            text += piece
            event = event or bool(piece) or choice.get("finish_reason") is None  # a closing chunk is none
        usage = obj.get("usage") or {}
        return Chunk(text=text, token_event=event, reported_tokens=usage.get("completion_tokens"))

    def needs_final(self) -> bool:
        return False  # some servers (transformers serve) end without [DONE]


def make_protocol(
    name: str,
    model: str = "default",
    chat: bool = False,
    send_ignore_eos: bool = True,
    include_usage: bool = True,
) -> Protocol:
    if name == "tgi":
        return TGIProtocol()
    if name == "openai":
        return OpenAIProtocol(model, chat=chat, send_ignore_eos=send_ignore_eos, include_usage=include_usage)
    raise ValueError(f"unknown protocol {name!r}: one of {', '.join(PROTOCOLS)}")


def discover_model(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> str:
    """The first model `/v1/models` lists, or "default"."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout, headers=headers)
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data and isinstance(data[0], dict) and data[0].get("id"):
                return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return "default"


# -- one request -------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    input_len: int
    requested_output_len: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # seconds from the benchmark's start
    ttft: float | None = None  # time to the first non-empty text chunk
    e2e: float | None = None  # time to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between consecutive non-empty chunks
    text: str = ""
    output_tokens: int = 0  # the count reports use: the server's (`by_events`) or the text re-tokenized
    reported_tokens: int | None = None  # the server's own count (TGI: token events or details; OpenAI: usage)
    chunks: int = 0  # non-empty text chunks received (token events with `by_events`)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self, with_text: bool = False) -> RequestRecord:
        out: RequestRecord = {
            "index": self.index,
            "input_len": self.input_len,
            "requested_output_len": self.requested_output_len,
            "ok": self.ok,
            "error": self.error,
            "start": self.start,
            "ttft": self.ttft,
            "e2e": self.e2e,
            "tpot": self.tpot,
            "itl": self.itl,
            "output_tokens": self.output_tokens,
            "reported_tokens": self.reported_tokens,
            "chunks": self.chunks,
        }
        if with_text:
            out["text"] = self.text
        return out


async def send_request(
    client: httpx.AsyncClient,
    protocol: Protocol,
    req: BenchRequest,
    ignore_eos: bool,
    count: Callable[[str], int],
    t_zero: float,
) -> RequestResult:
    """Send one streaming request and time its chunks; never raises (failures are in the result)."""
    res = RequestResult(req.index, req.input_len, req.output_len)
    t0 = time.perf_counter()
    res.start = t0 - t_zero
    last: float | None = None
    pieces: list[str] = []
    full_text: str | None = None
    token_events = 0
    final = False
    try:
        async with client.stream("POST", protocol.path, json=protocol.body(req, ignore_eos)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                raise _Failed(f"HTTP {resp.status_code}: {_short(body)}")
            parser = SSEParser()

            def handle(data: str) -> None:
                nonlocal last, full_text, token_events, final
                now = time.perf_counter()
                chunk = protocol.parse(data)
                if chunk.error is not None:
                    raise _Failed(chunk.error)
                if chunk.token_event if protocol.by_events else chunk.text:
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
                pieces.append(chunk.text)
                token_events += chunk.token_event
                if chunk.reported_tokens is not None:
                    res.reported_tokens = chunk.reported_tokens
                if chunk.full_text is not None:
                    full_text = chunk.full_text
                final = final or chunk.final

            async for line in resp.aiter_lines():
                if (data := parser.feed(line)) is not None:
                    handle(data)
            if (data := parser.close()) is not None:
                handle(data)
        res.e2e = time.perf_counter() - t0
        if protocol.needs_final() and not final:
            raise _Failed("the stream ended before the generation did")
        res.text = full_text if full_text is not None else "".join(pieces)
        if res.reported_tokens is None and token_events:
            res.reported_tokens = token_events
        if protocol.by_events:
            res.output_tokens = res.reported_tokens or token_events
        else:
            res.output_tokens = count(res.text)
        res.ok = True
    except _Failed as e:
        res.error = str(e)
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if res.e2e is None:
        res.e2e = time.perf_counter() - t0
    return res


class _Failed(Exception):
    pass


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


# -- the load ----------------------------------------------------------------------------------------
class _RequestText(TypedDict, total=False):
    text: str  # with --save-text


class RequestRecord(_RequestText):
    """A request's line in a benchmark's JSON (`RequestResult.to_json`)."""

    index: int
    input_len: int
    requested_output_len: int
    ok: bool
    error: str | None
    start: float
    ttft: float | None
    e2e: float | None
    tpot: float | None
    itl: list[float]
    output_tokens: int
    reported_tokens: int | None
    chunks: int


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration: float  # from the first send to the last answer


async def run_load(
    url: str,
    protocol: Protocol,
    requests: list[BenchRequest],
    *,
    count: Callable[[str], int],
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout: float = 600.0,
    headers: dict[str, str] | None = None,
    progress: Callable[[RequestResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    """Closed loop (`concurrency` workers, each sending its next request when its last one finishes) or
    open loop (Poisson arrivals at `request_rate`/s, with at most `concurrency` in flight when given)."""
    from pytgi.bench.workload import poisson_arrivals

    if request_rate is None and not concurrency:
        raise ValueError("give a concurrency or a request rate")
    limit = max(concurrency or len(requests), 1)
    # No keep-alive: a server that closes idle connections (llama-server does) would otherwise fail the
    # request that happens to reuse one; a fresh loopback connection costs ~0.1 ms.
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=0)
    tmo = httpx.Timeout(timeout, connect=30.0)
    results: list[RequestResult] = []

    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), timeout=tmo, limits=limits, headers=headers, transport=transport
    ) as client:

        def done(r: RequestResult) -> None:
            results.append(r)
            if progress is not None:
                progress(r)

        t_zero = time.perf_counter()
        if request_rate is None:
            queue = list(reversed(requests))

            async def worker() -> None:
                while queue:
                    done(await send_request(client, protocol, queue.pop(), ignore_eos, count, t_zero))

            await asyncio.gather(*(worker() for _ in range(min(limit, len(requests)))))
        else:
            sem = asyncio.Semaphore(limit)
            arrivals = poisson_arrivals(len(requests), request_rate, seed)

            async def one(req: BenchRequest, at: float) -> None:
                delay = at - (time.perf_counter() - t_zero)
                if delay > 0:
                    await asyncio.sleep(delay)
                async with sem:
                    done(await send_request(client, protocol, req, ignore_eos, count, t_zero))

            await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals)))
        duration = time.perf_counter() - t_zero
    results.sort(key=lambda r: r.index)
    return LoadResult(results, duration)
