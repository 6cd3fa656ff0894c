"""The OpenAI API as hf_paged answers it: errors, response bodies, stream chunks (the requests:
``openai_requests.py``). No FastAPI import here: the server (``serve.py``) does HTTP.
"""

import itertools
import re
import time
import uuid
from typing import Any

from hf_paged.engine.outputs import StreamDelta
from hf_paged.frontends.tool_calls import ToolCallStream, parse_tool_calls

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
                 include_usage: bool = False, tool_parser: str | None = None,
                 response_id: str | None = None):  # fmt: skip
        """``tool_parser``: a chat whose output may hold tool calls in that format (hf_paged.frontends.tool_calls);
        ``response_id``: the client's ``request_id`` (else a new id)."""
        self.kind = kind
        self.tool_parser = tool_parser
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its text, calls held back
        self.num_logprobs = num_logprobs or 0  # alternatives per token, when log-probs are asked
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.id = f"{prefix}-{response_id}" if response_id else new_id(prefix)
        self.created = int(time.time())
        self._started: set[int] = set()  # chat choices whose first chunk (with the role) went out

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[tuple[int, Any]], usage_: dict, prompt_logprobs: dict | None = None) -> dict:
        """The whole answer: ``choices`` are (index, CompletionOutput); ``prompt_logprobs``: choice index -> its
        prompt's ``RequestOutput.prompt_logprobs`` (vLLM's places: each completion choice, the top of a chat)."""
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion")
        scored = prompt_logprobs or {}
        body["choices"] = [self._choice(index, c.text or "", c.token_ids, c.logprobs, c.finish_reason,
                                        c.stop_reason) for index, c in choices]  # fmt: skip
        if self.kind == "completion":
            for choice in body["choices"]:
                choice["prompt_logprobs"] = prompt_logprobs_json(scored.get(choice["index"]))
        else:
            body["prompt_logprobs"] = prompt_logprobs_json(next(iter(scored.values()), None))
        body["usage"] = usage_
        return body

    def _choice(self, index, text, token_ids, logprobs, finish_reason, stop_reason) -> dict:
        choice = {"index": index}
        if self.kind == "completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
            if self.tool_parser is not None:
                content, calls = parse_tool_calls(self.tool_parser, text)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": [c.as_openai() for c in calls]}  # fmt: skip
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice["logprobs"] = self._logprobs(token_ids, logprobs)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = stop_reason
        return choice

    def chunk(self, index: int, delta: StreamDelta) -> dict | None:
        """One SSE chunk for a delta of choice ``index``; None when it carries nothing to send."""
        text, calls, finish_reason = delta.text, [], delta.finish_reason
        if self.tool_parser is not None:  # text from a call's opener on is held back until the end
            stream = self._tool_streams.setdefault(index, ToolCallStream(self.tool_parser))
            text = stream.feed(delta.text)
            if finish_reason is not None:
                rest, calls = stream.finish()
                text += rest
                finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        if not text and finish_reason is None and not (delta.logprobs and delta.token_ids):
            return None
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        choice: dict[str, Any] = {"index": index}
        if self.kind == "completion":
            choice["text"] = text
        else:
            message: dict[str, Any] = {"content": text}
            if index not in self._started:  # the role rides on the first chunk that carries content
                self._started.add(index)
                message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
            choice["delta"] = message
        choice["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs)
        choice["finish_reason"] = finish_reason
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


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's JSON of prompt log-probs: per prompt token None (the first) or {"token id": {"logprob", "rank",
    "decoded_token"}}, with -inf as -9999.0 (JSON has no infinity; vLLM's ``clamp_prompt_logprobs``)."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            str(token_id): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]  # fmt: skip
