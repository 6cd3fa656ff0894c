"""The server's endpoints besides generation: the ones vLLM's clients and tools call, and the API docs.

- ``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...], "add_generation_prompt", "tools", ...}`` ->
  ``{"count", "max_model_len", "tokens"}``; ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt"}``;
- ``GET /version``, ``GET|POST /ping`` (200 while the engine serves, as ``/health``), ``GET /v1/models/{id}``;
- ``POST /reset_prefix_cache``: every engine (each data-parallel replica) forgets its cached prefix blocks between
  two steps, then 200 with an empty body (vLLM's); requests in flight keep their blocks and run on;
- ``GET /openapi.json``, ``/docs``, ``/redoc``: behind the API key like every endpoint but ``/health`` and
  ``/ping`` (FastAPI's own serve them to anyone).
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from hf_paged.frontends.openai_api import APIError
from hf_paged.frontends.openai_requests import ChatMessage, render_chat
from hf_paged.serving.streaming import EngineDeadError


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: a text prompt, or chat messages with the chat template's options."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_routes(app: FastAPI, engine, model_name: str, max_model_len: int | None, authorize, parse,
               run_tokenizer) -> None:  # fmt: skip
    """Add the endpoints above to ``app``.

    Args:
        authorize: ``authorize(request)`` raises the 401 ``APIError``.
        parse: ``await parse(request, model_cls)``: the authorized, size-checked, validated body.
        run_tokenizer: ``await run_tokenizer(fn, *args)``: ``fn`` on the server's tokenizer thread.
    """
    from hf_paged import __version__

    tokenizer = engine.tokenizer

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "hf_paged",
                "max_model_len": max_model_len}  # fmt: skip

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        authorize(request)
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return card()

    @app.get("/version")
    async def version(request: Request):
        authorize(request)
        return {"version": __version__}

    async def ping():
        try:
            await engine.stats()
        except (EngineDeadError, RuntimeError) as err:
            raise APIError(503, f"the engine is not serving: {err}", type="server_error") from None
        return JSONResponse({})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        authorize(request)
        try:
            await engine.reset_prefix_cache()
        except (EngineDeadError, RuntimeError) as err:
            raise APIError(503, f"the engine is not serving: {err}", type="server_error") from None
        return Response(status_code=200)

    app.add_api_route("/ping", ping, methods=["GET"])
    app.add_api_route("/ping", ping, methods=["POST"], name="ping_post")  # a route a method: distinct OpenAPI ids

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body: TokenizeRequest = await parse(request, TokenizeRequest)
        if body.messages is not None:
            options = dict(add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                           continue_final_message=body.continue_final_message, chat_template=body.chat_template,
                           chat_template_kwargs=body.chat_template_kwargs)  # fmt: skip
            messages = [m.as_template_message() for m in body.messages]
            token_ids = await run_tokenizer(render_chat, tokenizer, messages, options)
            if body.add_special_tokens:
                token_ids = tokenizer.build_inputs_with_special_tokens(token_ids)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = await run_tokenizer(
                lambda: list(tokenizer(body.prompt, add_special_tokens=add_special)["input_ids"])
            )
        answer = {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids}
        if body.return_token_strs:
            answer["token_strs"] = tokenizer.convert_ids_to_tokens(token_ids)
        return answer

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body: DetokenizeRequest = await parse(request, DetokenizeRequest)
        vocab = len(tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await run_tokenizer(tokenizer.decode, body.tokens)}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        authorize(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        authorize(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        authorize(request)
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
