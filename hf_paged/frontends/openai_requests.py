"""OpenAI's request bodies as hf_paged reads them, and their SamplingParams.

Request bodies are pydantic models of every field OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` take
and of vLLM's extras. Each known field is honoured, or refused with a 400 that names it when it asks for
something hf_paged does not do (``_REFUSED``): never accepted and dropped. Unknown fields are ignored, as vLLM
and OpenAI do, since clients send new fields before servers know them. Every value check lives in
``SamplingParams``; its message is passed on with the OpenAI name of the field.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hf_paged.engine.params import SamplingParams, StructuredOutput
from hf_paged.frontends.openai_api import APIError, bad_value
from hf_paged.frontends.tool_calls import FORCED, forced_calls_schema, named_parser

# Request field -> (the values that ask for nothing, what the refusal adds). A field set to anything else is a 400.
_REFUSED = {
    "allowed_token_ids": ((), ""),
    "bad_words": ((), ""),
    "logits_processors": ((), ": a server does not run code sent by its clients"),
    "spaces_between_special_tokens": ((True,), " (special tokens are decoded as the tokenizer does)"),
    "priority": ((0,), ": requests are served first come, first served"),
    "return_tokens_as_token_ids": ((False,), ""),
    "return_token_ids": ((False,), ""),
    "cache_salt": ((), ""),
    "kv_transfer_params": ((), ": there is no disaggregated prefill"),
    "vllm_xargs": ((), ""),
    "structural_tag": ((), " (use `structured_outputs` with json, regex, choice or grammar)"),
    "guided_decoding_backend": (("xgrammar", "auto"), ": the backend is xgrammar"),
    "guided_whitespace_pattern": ((), ": JSON output is compact"),
    # OpenAI's chat fields beyond a text model's generation
    "audio": ((), ": text output only"),
    "modalities": ((["text"],), ": text output only"),
    "prediction": ((), " (predicted outputs)"),
    "reasoning_effort": ((), ""),
    "verbosity": ((), ""),
    "service_tier": (("auto", "default"), ""),
    "store": ((False,), ": nothing is stored"),
    "metadata": ((), ": it goes with `store`, and nothing is stored"),
    "web_search_options": ((), ""),
    "functions": ((), ": use `tools`"),
    "function_call": ((), ": use `tool_choice`"),
    "echo": ((False,), ""),
    "prompt_embeds": ((), ": prompts are text or token ids"),
}


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
    use_beam_search: bool | None = None  # vLLM: `n` beams, the n best returned
    length_penalty: float | None = None  # beam search only
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1 = the model's context
    request_id: str | None = None  # the response's id
    prompt_logprobs: int | None = None  # vLLM: each prompt token's log-prob and k alternatives (not streamed)
    # Fields refused unless they ask for nothing (see _REFUSED): typed loosely so the refusal names them.
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

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
        for name, (neutral, reason) in _REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                raise APIError(400, f"`{name}` is not supported by hf_paged{reason}", param=name)
        self.structured_output()  # a malformed constraint is a 400 before any work
        if self.length_penalty is not None and not self.use_beam_search:
            raise APIError(400, "`length_penalty` needs `use_beam_search: true`", param="length_penalty")
        if self.prompt_logprobs is not None and self.streams:  # vLLM refuses it too: chunks have no place for it
            raise APIError(400, "`prompt_logprobs` are not available with `stream: true`; send `stream: false`",
                           param="prompt_logprobs")  # fmt: skip
        if self.use_beam_search and self.streams:
            raise APIError(400, "`use_beam_search` does not stream: the beams are known at the end; send "
                                "`stream: false`", param="use_beam_search")  # fmt: skip
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or (k < 1 and k != -1)):
            raise APIError(400, f"`truncate_prompt_tokens` must be >= 1 or -1 (the model's context), got {k}",
                           param="truncate_prompt_tokens")  # fmt: skip

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint the request asks for, from whichever field says it: OpenAI's ``response_format``
        (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` or ``guided_*``; None for free text.

        Raises:
            APIError: 400 for two constraints at once, or one that is malformed (named by its field).
        """
        asked = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                asked.append(("response_format", dict(json_object=True)))
            elif kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise APIError(400, "`response_format` json_schema needs `json_schema.schema`, a JSON schema "
                                        "object", param="response_format")  # fmt: skip
                asked.append(("response_format", dict(json=schema)))
            elif kind != "text":
                raise APIError(400, "`response_format.type` must be 'text', 'json_object' or 'json_schema', got "
                                    f"{kind!r}", param="response_format")  # fmt: skip
        for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                asked.append((name, {field: getattr(self, name)}))
        if self.structured_outputs is not None:
            given = self.structured_outputs
            known = {"json", "regex", "choice", "grammar", "json_object"}
            if not isinstance(given, dict) or not set(given) <= known:
                raise APIError(400, f"`structured_outputs` must be an object with one of {sorted(known)}, got "
                                    f"{given!r:.200}", param="structured_outputs")  # fmt: skip
            asked.append(("structured_outputs", {k: v for k, v in given.items() if v not in (None, False)}))
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(400, f"one output constraint at a time, got {', '.join(f'`{n}`' for n, _ in asked)}",
                           param=asked[1][0])  # fmt: skip
        name, fields = asked[0]
        try:
            return StructuredOutput(**fields)
        except (ValueError, TypeError) as err:
            raise APIError(400, f"`{name}`: {err}", param=name) from None

    def truncate(self, token_ids: list[int], max_model_len: int | None) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM truncates on the left)."""
        k = self.truncate_prompt_tokens
        if k == -1:
            k = max_model_len
        return token_ids if k is None or len(token_ids) <= k else token_ids[-k:]

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; a bad value raises ``APIError`` 400 naming the field."""
        given = {name: value for name, value in self if value is not None}
        top_k = given.get("top_k", 0)
        beams = dict(beam_width=self.width, length_penalty=given.get("length_penalty", 1.0)) if self.use_beam_search \
            else {}  # fmt: skip
        try:
            return SamplingParams(
                **beams,
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
                prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=given.get("skip_special_tokens", True),
                include_stop_str_in_output=given.get("include_stop_str_in_output", False),
                structured_output=self.structured_output(),
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
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt
    prompt_embeds: Any = None

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
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as OpenAI returned them
    tool_call_id: str | None = None  # a tool message: the call it answers

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

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as objects, not OpenAI's JSON strings."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        raise APIError(400, f"a tool call's `arguments` must be a JSON object, got {arguments!r}",
                                       param="messages") from None  # fmt: skip
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        return message


def render_chat(tokenizer, messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template.

    ``options``: ``add_generation_prompt``, ``continue_final_message``, ``tools``, ``documents``,
    ``chat_template`` (a template that replaces the tokenizer's) and ``chat_template_kwargs`` (more variables).
    """
    if tokenizer is None:
        raise ValueError("chat messages need a tokenizer with a chat template")
    kwargs = dict(options.get("chat_template_kwargs") or {})
    for name in ("tools", "documents", "chat_template"):
        if options.get(name) is not None:
            kwargs[name] = options[name]
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False), **kwargs,
    )  # fmt: skip
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # False: at most one call
    # the chat template's options (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # refused unless they ask for nothing (_REFUSED)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    echo: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "`messages` must hold at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "`continue_final_message` continues the last message: send it with "
                                "`add_generation_prompt: false`", param="continue_final_message")  # fmt: skip
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "`continue_final_message` needs an assistant message last, got a "
                                f"{self.messages[-1].role!r} message", param="continue_final_message")  # fmt: skip
        self.tool_mode()

    def tool_mode(self) -> str:
        """ "none" (no tools reach the template, the output is text), "auto" (the model may call the tools),
        "required" (it must call one or more) or "named" (it must call the function ``tool_choice`` names)."""
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise APIError(400, f"`tool_choice` {choice!r} needs `tools`", param="tool_choice")
        if not self.tools or choice == "none":
            return "none"
        for tool in self.tools:
            if tool.get("type") != "function" or not isinstance((tool.get("function") or {}).get("name"), str):
                raise APIError(400, "each of `tools` must be {'type': 'function', 'function': {'name': ..., "
                                    f"'parameters': ...}}}}, got {tool!r}", param="tools")  # fmt: skip
        if choice in (None, "auto"):
            return "auto"
        if choice == "required":
            return "required"
        if isinstance(choice, dict) and choice.get("type") == "function":
            return "named"
        raise APIError(400, f"`tool_choice` must be 'none', 'auto', 'required' or {{'type': 'function', "
                            f"'function': {{'name': ...}}}}, got {choice!r}", param="tool_choice")  # fmt: skip

    def forced_tool_parser(self) -> str | None:
        """The parser of an output that ``tool_choice`` constrains to calls, or None."""
        mode = self.tool_mode()
        if mode == "required":
            return FORCED
        if mode == "named":
            return named_parser(self.tool_choice["function"]["name"])
        return None

    def structured_output(self) -> StructuredOutput | None:
        """As the base class; with ``tool_choice`` "required" or a named function, the calls' JSON schema."""
        asked = super().structured_output()
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return asked
        if asked is not None:
            raise APIError(400, f"`tool_choice` {self.tool_choice!r} constrains the output to tool calls: it does "
                                "not combine with another output constraint", param="tool_choice")  # fmt: skip
        try:
            schema = forced_calls_schema(self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        except ValueError as err:
            raise APIError(400, str(err), param="tool_choice") from None
        return StructuredOutput(json=schema)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]

    def template_options(self) -> dict[str, Any]:
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message,
                    tools=self.tools if self.tool_mode() != "none" else None, documents=self.documents,
                    chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs)  # fmt: skip

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
