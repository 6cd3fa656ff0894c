"""The OpenAI API as hf_paged speaks it: request bodies, their SamplingParams, responses, stream chunks, errors.

Request bodies are pydantic models of the fields OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` take,
plus vLLM's extras (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``skip_special_tokens``, ``include_stop_str_in_output``). Unknown fields are ignored (as
vLLM does: clients send new fields before servers know them); known fields hf_paged cannot honour are refused
with a 400 that names them, never silently dropped. Every value check lives in ``SamplingParams``; its message
is passed on with the OpenAI name of the field. No FastAPI import here: the server (``serve.py``) does HTTP.
"""

import itertools
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hf_paged.engine.outputs import StreamDelta
from hf_paged.engine.params import SamplingParams

# SamplingParams field -> the request field a client sent
_FIELD_NAMES = {"max_new_tokens": "max_tokens"}


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_value(err: Exception) -> APIError:
    """A ``ValueError``/``TypeError`` of hf_paged (SamplingParams, the engine's checks) as a 400 naming the field."""
    message = str(err)
    found = re.search(r"`(\w+)`", message)
    param = _FIELD_NAMES.get(found.group(1), found.group(1)) if found else None
    for internal, public in _FIELD_NAMES.items():
        message = message.replace(f"`{internal}`", f"`{public}`").replace(f"{internal} ", f"{public} ")
    return APIError(400, message, param=param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    # null is accepted wherever OpenAI accepts it, and means the default (some clients send every field).
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # default 1.0
    top_p: float | None = None  # default 1.0
    n: int | None = None  # default 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # default 0.0
    frequency_penalty: float | None = None  # default 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None  # vLLM: -1 or 0 = off
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None  # default True
    include_stop_str_in_output: bool | None = None

    @property
    def width(self) -> int:
        """``n``: choices per prompt."""
        return 1 if self.n is None else self.n

    @property
    def streams(self) -> bool:
        return bool(self.stream)

    def check_supported(self) -> None:
        """Refuse what hf_paged would otherwise ignore."""
        if self.logit_bias:
            raise APIError(400, "`logit_bias` is not supported by hf_paged", param="logit_bias")
        if self.stream_options is not None and not self.streams:
            raise APIError(400, "`stream_options` is only allowed with `stream: true`", param="stream_options")

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; a bad value raises ``APIError`` 400 naming the field."""
        given = {name: value for name, value in self if value is not None}
        top_k = given.get("top_k", 0)
        try:
            return SamplingParams(
                n=self.width,
                max_new_tokens=max_new_tokens,
                min_tokens=given.get("min_tokens", 0),
                temperature=given.get("temperature", 1.0),
                top_k=0 if top_k == -1 else top_k,
                top_p=given.get("top_p", 1.0),
                min_p=given.get("min_p", 0.0),
                seed=self.seed,
                repetition_penalty=given.get("repetition_penalty", 1.0),
                presence_penalty=given.get("presence_penalty", 0.0),
                frequency_penalty=given.get("frequency_penalty", 0.0),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                stop=() if self.stop is None else self.stop,
                ignore_eos=given.get("ignore_eos", False),
                logprobs=logprobs,
                skip_special_tokens=given.get("skip_special_tokens", True),
                include_stop_str_in_output=given.get("include_stop_str_in_output", False),
            )
        except (ValueError, TypeError) as err:
            raise bad_value(err) from None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or a batch (each gets ``n`` choices, indexed prompt-major)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "`echo` is not supported by hf_paged", param="echo")
        if self.suffix:
            raise APIError(400, "`suffix` is not supported by hf_paged", param="suffix")
        if self.best_of is not None and self.best_of != self.width:
            raise APIError(400, f"`best_of` must equal `n` ({self.width}) or be omitted, got {self.best_of}",
                           param="best_of")  # fmt: skip

    def prompts(self) -> list:
        """The prompts of the request: strings or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            return [[]]  # an empty prompt: the engine's check answers
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text: a string, or its ``{"type": "text"}`` parts joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"only text content parts are supported, got a part of type {part.get('type')!r}",
                               param="messages")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "`messages` must hold at least one message", param="messages")
        if self.tools:
            raise APIError(400, "`tools` are not supported by hf_paged", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"`response_format` {self.response_format.get('type')!r} is not supported by hf_paged;"
                                " only 'text'", param="response_format")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return super().sampling_params(max_new_tokens, logprobs)
        except APIError as err:
            if err.param == "logprobs":  # chat asks for alternatives with `top_logprobs`
                err.param = "top_logprobs"
                err.message = err.message.replace("`logprobs`", "`top_logprobs`")
            raise


_ID_STEM = uuid.uuid4().hex[:16]  # one random draw per process; a counter after it (os.urandom can be slow)
_ID_COUNTER = itertools.count()


def new_id(prefix: str) -> str:
    """A response id unique across servers and restarts (random stem) and within one (counter)."""
    return f"{prefix}-{_ID_STEM}{next(_ID_COUNTER):08x}"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


class Formatter:
    """Builds response bodies and stream chunks of one endpoint ("completion" or "chat") for one request."""

    def __init__(self, kind: str, model: str, tokenizer, num_logprobs: int | None = None,
                 include_usage: bool = False):  # fmt: skip
        self.kind = kind
        self.num_logprobs = num_logprobs or 0  # alternatives per token, when log-probs are asked
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self._started: set[int] = set()  # chat choices whose first chunk (with the role) went out

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[tuple[int, Any]], usage_: dict) -> dict:
        """The whole answer: ``choices`` are (index, CompletionOutput)."""
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion")
        body["choices"] = [self._choice(index, c.text or "", c.token_ids, c.logprobs, c.finish_reason,
                                        c.stop_reason) for index, c in choices]  # fmt: skip
        body["usage"] = usage_
        return body

    def _choice(self, index, text, token_ids, logprobs, finish_reason, stop_reason) -> dict:
        choice = {"index": index}
        if self.kind == "completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = self._logprobs(token_ids, logprobs)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = stop_reason
        return choice

    def chunk(self, index: int, delta: StreamDelta) -> dict | None:
        """One SSE chunk for a delta of choice ``index``; None when it carries nothing to send."""
        if not delta.text and delta.finish_reason is None and not (delta.logprobs and delta.token_ids):
            return None
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        choice: dict[str, Any] = {"index": index}
        if self.kind == "completion":
            choice["text"] = delta.text
        else:
            message = {"content": delta.text}
            if index not in self._started:  # the role rides on the first chunk that carries content
                self._started.add(index)
                message = {"role": "assistant", "content": delta.text}
            choice["delta"] = message
        choice["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs)
        choice["finish_reason"] = delta.finish_reason
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_: dict) -> dict:
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        body["choices"] = []
        body["usage"] = usage_
        return body

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> dict | None:
        """OpenAI's log-prob objects: the legacy completions layout, or chat's ``content`` list."""
        if logprobs is None:
            return None
        tokens = [self._token(t) for t in token_ids]
        # Each entry holds the sampled token and the k most likely ones: the k best are the alternatives.
        tops = [sorted(lp.items(), key=lambda kv: -kv[1])[: self.num_logprobs] for lp in logprobs]
        if self.kind == "completion":
            offsets, pos = [], 0
            for token in tokens:
                offsets.append(pos)
                pos += len(token)
            return {
                "tokens": tokens,
                "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": [{self._token(t): v for t, v in top} for top in tops],
                "text_offset": offsets,
            }
        return {
            "content": [
                {
                    "token": token,
                    "logprob": lp[t],
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": self._token(a), "logprob": v, "bytes": list(self._token(a).encode())} for a, v in top
                    ],
                }
                for t, token, lp, top in zip(token_ids, tokens, logprobs, tops, strict=True)
            ]
        }

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id])
