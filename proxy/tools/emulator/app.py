"""``build_emulator_app(config)``: the aiohttp application of the vLLM emulator."""

from __future__ import annotations

import secrets
import time
import uuid

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .config import EmulatorConfig
from .generate import (
    CONFIG_KEY,
    REQUEST_ID_HEADER,
    STATE_KEY,
    error_response,
    handle_generation,
    read_json_object,
)
from .injections import EmulatorState
from .metrics import CONTENT_TYPE, render_metrics
from .plan import resolve_model
from .schemas import RequestError, TokenizeRequest, parse, render_messages
from .vocab import encode_pieces

CREATED_KEY = web.AppKey("emulator_created", int)


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "completion")


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG_KEY]
    created = request.app[CREATED_KEY]
    data: list[dict[str, object]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [],
        }
        for name in cfg.models
    ]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": request.app[CONFIG_KEY].version})


async def metrics(request: web.Request) -> web.Response:
    text = render_metrics(request.app[CONFIG_KEY], request.app[STATE_KEY])
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG_KEY]
    try:
        req = parse(TokenizeRequest, await read_json_object(request))
        resolve_model(cfg, req.model)
        if req.messages is not None:
            if req.add_generation_prompt and req.continue_final_message:
                raise RequestError(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
            text = render_messages(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                cfg.template_drops_reasoning,
            )
        elif req.prompt is not None:
            text = req.prompt
        else:
            raise RequestError("Either `prompt` or `messages` is required.", param="prompt")
    except RequestError as err:
        return error_response(err)
    pieces = encode_pieces(text)
    request.app[STATE_KEY].learn(pieces)
    return _json(
        {
            "count": len(pieces),
            "max_model_len": cfg.max_model_len,
            "tokens": [p.token_id for p in pieces],
            "token_strs": [p.text for p in pieces] if req.return_token_strs else None,
        }
    )


async def injections(request: web.Request) -> web.Response:
    """All records, or one request's (``?request_id=``: the X-Request-Id it was sent with)."""
    return _json(request.app[STATE_KEY].injections(request.query.get("request_id")))


async def stats(request: web.Request) -> web.Response:
    return _json(request.app[STATE_KEY].stats())


async def reset(request: web.Request) -> web.Response:
    request.app[STATE_KEY].reset()
    return _json({"ok": True})


UNAUTHORIZED_BODY = orjson.dumps({"error": "Unauthorized"})


def _auth_middleware(api_key: str) -> Middleware:
    """vLLM's AuthenticationMiddleware: only paths under /v1 need the key; 401 otherwise."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode()
            if not secrets.compare_digest(given, expected):
                return web.Response(
                    body=UNAUTHORIZED_BODY, status=401, content_type="application/json"
                )
        return await handler(request)

    return check


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's XRequestIdMiddleware: echo the request's X-Request-Id, else a fresh uuid."""
    response.headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


def build_emulator_app(config: EmulatorConfig | None = None) -> web.Application:
    """A fresh emulator application with its own state (nothing is shared between apps)."""
    cfg = config or EmulatorConfig()
    app = web.Application(middlewares=[_auth_middleware(cfg.api_key)] if cfg.api_key else [])
    if cfg.enable_request_id_headers:
        app.on_response_prepare.append(_add_request_id)
    app[CONFIG_KEY] = cfg
    app[STATE_KEY] = EmulatorState(seed=cfg.seed)
    app[CREATED_KEY] = int(time.time())
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/emulator/injections", injections)
    app.router.add_get("/emulator/stats", stats)
    app.router.add_post("/emulator/reset", reset)
    return app
