"""The server's ASGI middlewares on a bare app (no engine): which routes an API key leaves open,
the early 429, the body limit."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pytgi.api.middleware import ApiKeyMiddleware, OverloadMiddleware, PayloadLimitMiddleware


async def _ok(request):
    return PlainTextResponse(str(len(await request.body())))


PATHS = [
    "/health",
    "/",
    "/metrics",
    "/info",
    "/docs",
    "/openapi.json",
    "/v1/models",
    "/v1/models/x",
    "/generate",
]
APP = Starlette(routes=[Route(p, _ok, methods=["GET", "POST"]) for p in PATHS])


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_the_key_guards_every_route_but_the_exempt_ones() -> None:
    default = ApiKeyMiddleware(APP, "k")
    assert [p for p in PATHS if _call(default, "GET", p).status_code == 200] == ["/health", "/"]
    assert _call(default, "POST", "/").status_code == 401  # POST / generates: guarded
    assert _call(default, "GET", "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    opened = ApiKeyMiddleware(APP, "k", exempt=("metrics", "models"))
    assert [p for p in PATHS if _call(opened, "GET", p).status_code == 200] == [
        "/metrics",
        "/v1/models",
        "/v1/models/x",
    ]
    assert _call(ApiKeyMiddleware(APP, "k", exempt=()), "GET", "/health").status_code == 401


def test_over_the_limit_a_generation_is_refused_before_its_body_is_read() -> None:
    app = Starlette(
        routes=APP.routes, middleware=[Middleware(OverloadMiddleware)]
    )  # it reads the app's state
    infer = SimpleNamespace(in_flight=2, max_concurrent_requests=2)
    counts: list[str] = []
    count = SimpleNamespace(inc=lambda: counts.append("request"))
    failure = SimpleNamespace(labels=lambda kind: SimpleNamespace(inc=lambda: counts.append(kind)))
    app.state.pytgi = SimpleNamespace(
        infer=infer, metrics=SimpleNamespace(request_count=count, request_failure=failure)
    )
    r = _call(app, "POST", "/generate", json={"inputs": "x"})
    assert r.status_code == 429 and r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert counts == ["request", "overloaded"]  # in TGI's metrics, as the routes count theirs
    assert _call(app, "GET", "/health").status_code == 200  # not a generation
    infer.in_flight = 1
    assert _call(app, "POST", "/generate", json={"inputs": "x"}).status_code == 200


def test_a_streamed_body_over_the_limit_is_413_and_one_under_it_arrives_whole() -> None:
    app = PayloadLimitMiddleware(APP, limit=1000)

    async def chunks(n: int):
        for _ in range(n):
            yield b"x" * 100

    r = _call(app, "POST", "/generate", content=chunks(11))
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"
    r = _call(app, "POST", "/generate", content=chunks(9))
    assert r.status_code == 200 and r.text == "900"
