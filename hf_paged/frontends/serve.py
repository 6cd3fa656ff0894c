"""``hf-paged serve``: an OpenAI-compatible HTTP server over an AsyncEngine (FastAPI + uvicorn).

    hf-paged serve                                  # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    hf-paged serve ./my-model --port 8080 --api-key "$KEY" --max-queue 128
    hf-paged serve ./my-model --data-parallel 2     # one engine process per GPU behind this server
    hf-paged serve ./my-model --data-parallel 2 --api-server-count 4   # 4 HTTP processes (api_servers.py)

The engine is a DataParallelEngine — N replica processes (``--data-parallel N``), or one (``--engine-process``,
the default on CUDA) so the engine and this HTTP loop share no GIL; the server tokenises, routes and forwards their
deltas — or an AsyncEngine (one batcher on a thread of the server's process; the default on the CPU).

Streaming at saturation: a stream's deltas queued while its consumer was busy are joined into one event
(RequestStream), chats are tokenised on a tokenizer thread (the Rust tokenizer releases the GIL), and a one-prompt
request reads its stream directly. What is left per request (HTTP parsing, validation, the chat template, events)
runs in this one process and is what limits the served throughput when hundreds of requests arrive at once;
``--api-server-count N`` (hf_paged.frontends.api_servers) runs N such processes over the engine processes.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as server-sent events ending
with ``data: [DONE]``; chats parse tool calls, ``hf_paged.frontends.tool_calls``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), and (``serve_routes.py``) ``/tokenize``, ``/detokenize``,
``/version``, ``/ping``, ``/reset_prefix_cache``, ``/v1/models/{id}``, ``/docs``.

Every request is checked before the engine sees it, and answered OpenAI-style
(``{"error": {"message", "type", "param", "code"}}``):

- 401: ``--api-key`` is set and the ``Authorization: Bearer`` header does not match (every endpoint but /health);
- 400: a body that is not JSON or not the endpoint's shape, a sampling value out of range, a field hf_paged
  does not support (``logit_bias``, ``echo``, ``tools``, ...), a prompt longer than ``--max-prompt-tokens`` or
  whose prompt + ``max_tokens`` exceeds the model's context (``code: "context_length_exceeded"``, as OpenAI
  answers), a request that could never fit the KV pool;
- 404: a ``model`` other than the one served;
- 413: a body over ``--max-body-bytes``;
- 503: ``--max-queue`` requests are already in flight (``Retry-After: 1``), or the engine has stopped; a request
  of more prompts than ``--max-queue`` is a 400 (retrying cannot help), checked before any per-prompt work.

A client that disconnects mid-request has its request aborted and its blocks freed. On SIGTERM uvicorn stops
accepting connections, the requests in flight get ``--shutdown-timeout`` seconds, then the engine aborts what is
left and their streams end with a finish_reason "abort" chunk and ``[DONE]`` (``make_server``).
"""

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError

from hf_paged.engine.request import RequestOutput
from hf_paged.frontends.openai_api import APIError, Formatter, bad_value, usage
from hf_paged.frontends.openai_requests import ChatCompletionRequest, CompletionRequest, render_chat
from hf_paged.frontends.serve_metrics import FrontObservations, Metrics
from hf_paged.frontends.serve_routes import add_routes
from hf_paged.frontends.tool_calls import KEEPS_SPECIAL_TOKENS, choose_parser
from hf_paged.serving.async_engine import AsyncEngine
from hf_paged.serving.data_parallel import DataParallelEngine
from hf_paged.serving.streaming import EngineDeadError, RequestStream

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


def create_app(
    engine: AsyncEngine | DataParallelEngine,
    model_name: str,
    api_key: str | None = None,
    max_queue: int = 256,
    max_prompt_tokens: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    observations: FrontObservations | None = None,
    tool_call_parser: str | None = "auto",
    metric_names: str = "hf_paged",
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``; shutting the app down shuts the engine down.

    Args:
        engine: the AsyncEngine or DataParallelEngine (with a tokenizer: prompts are text and chats).
        model_name: the ``model`` clients name; any other is a 404.
        api_key: None = no authentication; else the Bearer token every endpoint but /health requires.
        max_queue: most requests in flight; more are answered 503.
        max_prompt_tokens: longest prompt accepted (None = the model's context).
        max_body_bytes: largest request body accepted (413 beyond).
        observations: where this app counts its requests' latencies for /metrics (one of several API servers'
            rows: ``hf_paged.frontends.api_servers``); None: its own.
        tool_call_parser: the format of tool calls in the model's output (``hf_paged.frontends.tool_calls.PARSERS``),
            or "auto": the one the chat template writes.
        metric_names: /metrics names: "hf_paged" (``hf_paged_*``) or "vllm" (vLLM's ``vllm:*``).
    """
    if engine.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer: ContinuousBatcher(model, tokenizer=...)")
    choose_parser(tool_call_parser, None)  # a wrong name fails here, not at the first request
    inputs = engine.inputs
    max_model_len = inputs.max_model_len
    metrics = Metrics(observations, model_name, metric_names)

    tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf_paged-tokenizer")

    stopping: list[asyncio.Future] = []  # the engine's shutdown, once started

    async def drain(timeout_s: float) -> None:
        """Shut the engine down once: the requests in flight get ``timeout_s``, then they end "abort"."""
        if not stopping:
            stopping.append(asyncio.ensure_future(engine.shutdown(drain_timeout_s=timeout_s)))
        await stopping[0]

    @asynccontextmanager
    async def lifespan(app):
        yield
        tokenizer_thread.shutdown(wait=False)
        await drain(0.0)

    # The API docs are served by add_routes, behind the key (FastAPI's own would answer anyone).
    app = FastAPI(title="hf_paged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.drain = drain

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")  # fmt: skip

    async def read_body(request: Request, model_cls):
        authorize(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise APIError(413, f"the request body has {size} bytes; this server accepts at most {max_body_bytes}",
                           code="request_too_large")  # fmt: skip
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"the request body exceeds {max_body_bytes} bytes", code="request_too_large")
        try:
            parsed = model_cls.model_validate_json(bytes(body))
        except ValidationError as err:
            raise _invalid(err) from None
        if parsed.model is not None and parsed.model != model_name:
            raise APIError(404, f"the model {parsed.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        check = getattr(parsed, "check_supported", None)
        if check is not None:
            check()
        return parsed

    def admit(num_requests: int) -> None:
        if num_requests > max_queue:  # would never be admitted: retrying cannot help
            raise APIError(400, f"the request has {num_requests} prompts; this server runs at most {max_queue} "
                                "requests at once", param="prompt")  # fmt: skip
        if engine.num_unfinished + num_requests > max_queue:
            raise APIError(503, f"the server is at its limit of {max_queue} requests in flight; retry later",
                           type="server_error", code="overloaded")  # fmt: skip

    async def run_tokenizer(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizer_thread, fn, *args)

    async def tokenize(prompt, param: str, encode=None) -> list[int]:
        """Token ids of a text, token ids or a chat; refuses prompts beyond ``max_prompt_tokens`` or the context.

        Text and chats are tokenised on the tokenizer's own thread: the Rust tokenizer releases the GIL, so the event
        loop streams the other requests meanwhile (480 chats arriving at once cost ~1 s of loop time otherwise). One
        thread: a fast tokenizer's call mutates its padding/truncation state and fails ("Already borrowed") when two
        threads call it at once. ``encode``: ``encode(prompt) -> token ids`` for a text or chat (the request's
        options), else the engine's own tokenisation."""
        try:
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                _, token_ids = inputs.tokenize(prompt)
            elif encode is not None:
                token_ids = await run_tokenizer(encode, prompt)
            else:
                _, token_ids = await run_tokenizer(inputs.tokenize, prompt)
        except APIError:
            raise
        except Exception as err:  # ValueError/TypeError, or the chat template refusing the messages (jinja)
            raise APIError(400, str(err), param=param) from None
        limit = max_prompt_tokens if max_prompt_tokens is not None else max_model_len
        if limit is not None and len(token_ids) > limit:
            raise APIError(400, f"the prompt has {len(token_ids)} tokens; this server accepts at most {limit}",
                           param=param, code="context_length_exceeded")  # fmt: skip
        return token_ids

    def max_new_tokens(asked: int | None, num_prompt_tokens: int, width: int) -> int:
        """``max_tokens`` as asked, else as much as the context and the pool allow (chat's default)."""
        room = (max_model_len or 1 << 30) - num_prompt_tokens
        if asked is not None:
            if asked > room:
                raise APIError(400, f"`max_tokens` ({asked}) + the prompt ({num_prompt_tokens} tokens) exceed the "
                               f"model's context of {max_model_len} tokens", param="max_tokens",
                               code="context_length_exceeded")  # fmt: skip
            return asked
        bs, num_blocks = inputs.block_size, inputs.num_blocks
        prompt_blocks = -(-num_prompt_tokens // bs)
        fits = ((num_blocks - prompt_blocks) // width - 1) * bs  # as InputProcessor.validate counts, shared
        if width > 1:
            fits = min(fits, (num_blocks // width) * bs - num_prompt_tokens)
        return max(1, min(room, fits))

    def submit(prompts: list[list[int]], params, request_id: str) -> list[RequestStream]:
        admit(len(prompts))
        streams = []
        try:
            for i, token_ids in enumerate(prompts):
                streams.append(engine.stream(token_ids, params[i], request_id=f"{request_id}-{i}"))
        except (ValueError, TypeError) as err:
            for stream in streams:
                stream.abort()
            raise bad_value(err) from None
        except (EngineDeadError, RuntimeError) as err:
            raise APIError(503, f"the engine is not serving: {err}", type="server_error") from None
        metrics.front.accepted(len(streams))
        return streams

    async def answer(request: Request, fmt: Formatter, streams: list[RequestStream], n: int,
                     num_prompt_tokens: list[int], stream: bool):  # fmt: skip
        if stream:
            return StreamingResponse(_sse(fmt, streams, n, num_prompt_tokens, metrics),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            outputs = await _unless_disconnected(request, _collect(streams))
        except Exception as err:  # a failed step (the engine serves on)
            metrics.front.aborted(len(streams))
            raise APIError(500, f"generation failed: {err}", type="server_error") from None
        if outputs is None:  # the client left: its requests were aborted
            metrics.front.aborted(len(streams))
            return Response(status_code=499)
        for output in outputs:
            metrics.front.observe(output)
        choices = [(p * n + c.index, c) for p, out in enumerate(outputs) for c in out.outputs]
        scored = {p * n + c.index: out.prompt_logprobs for p, out in enumerate(outputs) for c in out.outputs}
        num_completion = sum(len(c.token_ids) for _, c in choices)
        cached = sum(out.num_cached_tokens for out in outputs)
        return JSONResponse(fmt.response(choices, usage(sum(num_prompt_tokens), num_completion, cached), scored))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await read_body(request, CompletionRequest)
        texts = body.prompts()
        admit(len(texts))  # before any per-prompt work: a body of a million prompts costs one check
        special = body.add_special_tokens

        def encode(text: str) -> list[int]:
            return list(engine.tokenizer(text, add_special_tokens=special)["input_ids"])

        prompts = [await tokenize(p, "prompt", encode) for p in texts]
        prompts = [body.truncate(p, max_model_len) for p in prompts]
        params = [body.sampling_params(max_new_tokens(body.max_tokens, len(p), body.width), body.logprobs)
                  for p in prompts]  # fmt: skip
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        fmt = Formatter("completion", model_name, engine.tokenizer, body.logprobs, include_usage,
                        response_id=body.request_id)  # fmt: skip
        streams = submit(prompts, params, fmt.id)
        return await answer(request, fmt, streams, body.width, [len(p) for p in prompts], body.streams)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
        admit(1)
        parser = body.forced_tool_parser()  # tool_choice "required" or named: the output is JSON calls
        if body.tool_mode() == "auto":
            parser = choose_parser(tool_call_parser, body.chat_template or engine.tokenizer.chat_template)
            if parser is None:
                raise APIError(400, "`tools` need a chat template that writes tool calls; this model's shows no known "
                                    "format: start the server with --tool-call-parser", param="tools")  # fmt: skip
        options = body.template_options()

        def encode(messages) -> list[int]:
            token_ids = render_chat(engine.tokenizer, messages, options)
            if body.add_special_tokens:
                return engine.tokenizer.build_inputs_with_special_tokens(token_ids)
            return token_ids

        token_ids = body.truncate(await tokenize(body.template_messages(), "messages", encode), max_model_len)
        params = body.sampling_params(max_new_tokens(body.max_tokens_asked(), len(token_ids), body.width),
                                      body.num_logprobs())  # fmt: skip
        if parser in KEEPS_SPECIAL_TOKENS and body.skip_special_tokens is None:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the call's marker is a special token
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        fmt = Formatter("chat", model_name, engine.tokenizer, body.num_logprobs(), include_usage, tool_parser=parser,
                        response_id=body.request_id)  # fmt: skip
        streams = submit([token_ids], [params], fmt.id)
        return await answer(request, fmt, streams, body.width, [len(token_ids)], body.streams)

    add_routes(app, engine, model_name, max_model_len, authorize, read_body, run_tokenizer)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "hf_paged",
                "max_model_len": max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        try:
            await engine.stats()
        except (EngineDeadError, RuntimeError) as err:
            raise APIError(503, f"the engine is not serving: {err}", type="server_error") from None
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        try:
            metrics.engine.stats = await engine.stats()
        except (EngineDeadError, RuntimeError):
            metrics.engine.stats = None
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _invalid(err: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the field (``messages.0.role``), without pydantic's union-member tags."""
    errors = err.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {errors[0]['msg']}")

    def field(loc) -> str:
        return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))

    param = field(errors[0]["loc"]) or None
    top = (param or "").split(".")[0]
    reasons = list(dict.fromkeys(e["msg"] for e in errors if field(e["loc"]).split(".")[0] == top))  # a union: each
    return APIError(400, f"invalid `{param}`: {'; or '.join(reasons)}" if param else reasons[0], param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """Run every stream to its end; their final outputs in order."""

    async def one(stream: RequestStream) -> RequestOutput:
        async for _ in stream:
            pass
        return stream.output

    try:
        return list(await asyncio.gather(*(one(s) for s in streams)))
    finally:
        for stream in streams:
            await stream.aclose()  # a no-op for finished ones; aborts the rest (an error or a cancel)


async def _unless_disconnected(request: Request, coro):
    """``await coro``, cancelled (None returned) if the client disconnects first."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else None


async def _sse(fmt: Formatter, streams: list[RequestStream], n: int, num_prompt_tokens: list[int],
               metrics: Metrics) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events of several streams (a batch of prompts), merged as their deltas come.

    Starlette cancels this generator when the client disconnects: ``finally`` aborts what still runs.
    """
    tasks: list[asyncio.Future] = []
    num_completion = 0
    num_observed = 0  # streams that ended with their final output; the others count as aborted at the end
    try:
        async for prompt_idx, item in _merged(streams, tasks):
            if item is None:
                metrics.front.observe(streams[prompt_idx].output)
                num_observed += 1
                continue
            if isinstance(item, Exception):  # a failed step: OpenAI streams end with an error event
                error = item if isinstance(item, APIError) else APIError(500, str(item), type="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            num_completion += len(item.token_ids)
            chunk = fmt.chunk(prompt_idx * n + item.index, item)
            if chunk is not None:
                yield f"data: {json.dumps(chunk)}\n\n"
        else:  # every stream ended
            if fmt.include_usage:
                cached = sum(s.output.num_cached_tokens for s in streams if s.output is not None)
                yield f"data: {json.dumps(fmt.usage_chunk(usage(sum(num_prompt_tokens), num_completion, cached)))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        metrics.front.aborted(len(streams) - num_observed)
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


async def _merged(streams: list[RequestStream], tasks: list[asyncio.Future]):
    """``(prompt index, delta)`` of every stream as they come, ``(index, None)`` when one ends, ``(index, error)``
    when one fails. One stream (the common request) is read directly; several through a task each, whose futures
    go to ``tasks`` for the caller to cancel."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        except Exception as err:
            yield 0, err
            return
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt_idx: int, stream: RequestStream):
        try:
            async for delta in stream:
                queue.put_nowait((prompt_idx, delta))
            queue.put_nowait((prompt_idx, None))
        except Exception as err:
            queue.put_nowait((prompt_idx, err))

    tasks += [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    while remaining:
        prompt_idx, item = await queue.get()
        if item is None or isinstance(item, Exception):
            remaining -= 1
        yield prompt_idx, item


def run(
    engine: AsyncEngine | DataParallelEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 256,
    max_prompt_tokens: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_timeout_s: float = 30.0,
    tool_call_parser: str | None = "auto",
    metric_names: str = "hf_paged",
) -> None:
    """Serve ``engine`` with uvicorn until SIGINT/SIGTERM (see ``create_app`` for the arguments).

    On the signal uvicorn stops accepting connections and gives the requests in flight ``shutdown_timeout_s``
    seconds; then the app's shutdown aborts what is left in the engine and stops its thread.
    """
    warn_if_open(host, api_key)
    app = create_app(engine, model_name, api_key, max_queue, max_prompt_tokens, max_body_bytes,
                     tool_call_parser=tool_call_parser, metric_names=metric_names)  # fmt: skip
    make_server(app, shutdown_timeout_s, host=host, port=port, log_level="info").run()


# Seconds uvicorn waits past the engine's drain: the aborted streams' last chunk and [DONE] go out in them.
STREAM_END_GRACE_S = 5.0


def make_server(app: FastAPI, shutdown_timeout_s: float, server_cls=None, **config):
    """A uvicorn server of ``app`` (from ``create_app``) whose shutdown ends every stream properly.

    On SIGTERM (``should_exit``) the engine drains: the requests in flight get ``shutdown_timeout_s`` seconds, then
    the engine aborts the rest and their streams end with a finish_reason "abort" chunk and ``[DONE]``; uvicorn
    itself waits ``STREAM_END_GRACE_S`` longer before it cuts connections. ``config``: uvicorn.Config's arguments;
    ``server_cls``: a subclass of uvicorn.Server to start from.
    """
    import uvicorn

    class DrainingServer(server_cls or uvicorn.Server):
        async def shutdown(self, sockets=None):
            drained = asyncio.ensure_future(app.state.drain(shutdown_timeout_s))
            try:
                await super().shutdown(sockets=sockets)
            finally:
                await drained

    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout_s + STREAM_END_GRACE_S, **config)
    return DrainingServer(config)


def warn_if_open(host: str, api_key: str | None) -> None:
    """Log a warning when ``host`` is reachable from other machines and no API key guards it."""
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
