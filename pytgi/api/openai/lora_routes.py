"""LoRA adapters loaded and unloaded at run time: vLLM's two routes, off unless the operator turns them
on (`--enable-lora-runtime-updates`, or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), as vLLM keeps
them; TGI has none. Off, they are not routes at all (404). On, a client's `lora_path` is read only from
inside `--lora-dirs` (after symlinks and `..`), and a Hub id is fetched only with
`--allow-hub-adapters`: every other path is refused with one message, whether or not it exists, so
that the routes tell a client nothing about the server's files (docs/security.md). Adapters given at
start (`--lora-adapters`) are the operator's and are not checked here."""

from __future__ import annotations

import os

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pytgi.api.openai.error_shape import OpenAIError, invalid
from pytgi.api.state import state_of
from pytgi.core.adapters import HUB_PREFIX, AdapterError, check_name
from pytgi.core.config import ServerConfig
from pytgi.core.errors import EngineDead
from pytgi.core.hub import parse_hub_id

router = APIRouter()

NOT_ALLOWED = (
    "loading an adapter from this lora_path is not allowed: give a directory inside the server's "
    "--lora-dirs (or a Hub id, where the server allows them with --allow-hub-adapters)"
)


def runtime_updates(config: ServerConfig) -> bool:
    """Whether the routes are on."""
    vllm = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")
    return config.enable_lora_runtime_updates or vllm


def install(app: FastAPI, config: ServerConfig) -> None:
    if runtime_updates(config):
        app.include_router(router)


def allowed_source(path: str, dirs: tuple[str, ...], hub: bool) -> str:
    """What the engine may load for a client's `lora_path`: a directory inside one of `dirs` (the real
    path, symlinks and `..` resolved; a relative path looked up in each), or, with `hub`, a Hub id
    (marked so that the engine never reads it as a local path). Anything else: `AdapterError` with
    NOT_ALLOWED, the same whether or not the path exists."""
    roots = [os.path.realpath(os.path.expanduser(d)) for d in dirs]
    try:
        path.encode()  # a lone surrogate is no file name
    except UnicodeError:
        path = ""
    if path and "\0" not in path:
        candidates = [path] if os.path.isabs(path) else [os.path.join(r, path) for r in roots]
        for candidate in candidates:
            real = os.path.realpath(candidate)
            if any(os.path.commonpath([real, r]) == r for r in roots) and os.path.isdir(real):
                return real
        ref = parse_hub_id(path)
        if hub and ref is not None and ref.tag is None and ref.file is None:
            return HUB_PREFIX + path
    raise AdapterError(NOT_ALLOWED)


class LoadLoraAdapter(BaseModel):
    lora_name: str
    lora_path: str  # a PEFT adapter directory inside --lora-dirs, or a Hub id (--allow-hub-adapters)


class UnloadLoraAdapter(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; not needed here


def _engine_gone(exc: EngineDead) -> OpenAIError:
    return OpenAIError(503, f"the engine is not running: {exc}", "server_error", None, None)


@router.post("/v1/load_lora_adapter", tags=["LoRA"])
async def load_lora_adapter(request: Request, body: LoadLoraAdapter) -> Response:
    """Serve one more LoRA adapter; requests may name it as soon as this answers."""
    st, name = state_of(request), body.lora_name
    if name in st.client.adapters.served or name == st.config.model_id:
        raise invalid(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    cfg = st.config
    try:
        check_name(name)
    except AdapterError as exc:
        raise invalid(str(exc), "lora_name") from None
    try:
        source = allowed_source(body.lora_path, cfg.lora_dirs, cfg.allow_hub_adapters)
        await st.client.adapter(name, source)
    except AdapterError as exc:
        raise invalid(str(exc), "lora_path") from None
    except EngineDead as exc:
        raise _engine_gone(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", tags=["LoRA"])
async def unload_lora_adapter(request: Request, body: UnloadLoraAdapter) -> Response:
    """Stop serving an adapter: new requests for it are refused at once; this answers once the ones
    already running are done."""
    st, name = state_of(request), body.lora_name
    if name not in st.adapters:
        raise OpenAIError(
            404,
            f"The lora adapter '{name}' cannot be found.",
            "invalid_request_error",
            "lora_name",
            "lora_adapter_not_found",
        )
    try:
        await st.client.adapter(name, None)  # the engine refuses it to new requests as it reads this
    except AdapterError as exc:
        raise invalid(str(exc), "lora_name") from None
    except EngineDead as exc:
        raise _engine_gone(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
