"""Tool calls in generated text, in the formats of the common chat templates, as OpenAI's ``tool_calls``.

- ``hermes`` (Hermes, Qwen 2.5/3, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, after optional text;
- ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}`` (or several joined by
  ``;``), optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional text.

When ``tool_choice`` forces calls the output is constrained to JSON instead (``forced_calls_schema``), whatever
the template's format, and read with ``FORCED`` ("required": ``[{"name": ..., "parameters": {...}}, ...]``) or
``named_parser(name)`` (the one function's arguments object): even a model that knows nothing returns valid calls.

A call whose JSON does not parse leaves the text as it is (content, no call), as vLLM's parsers do. The parser is
the server's ``--tool-call-parser``, or found in the chat template (``choose_parser``).
"""

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")
FORCED = "required"  # the parser of a forced-calls output (tool_choice "required")
_NAMED = "named:"  # named_parser(name): tool_choice names one function
# The text that opens a call in each format: the stream holds text back from there.
_OPENERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",)}
# The markers are special tokens in some tokenizers: decoding must keep them for these formats.
KEEPS_SPECIAL_TOKENS = {"llama3_json", "mistral"}
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def choose_parser(name: str | None, chat_template: str | None) -> str | None:
    """The tool-call format: ``name`` if given (one of ``PARSERS``; "auto" = from the template), else the one the
    chat template writes; None when the template shows none of them.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name not in (None, "auto"):
        if name not in PARSERS:
            raise ValueError(f"`tool_call_parser` must be one of {['auto', *PARSERS]}, got {name!r}")
        return name
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    return None


def named_parser(name: str) -> str:
    return _NAMED + name


def forced_calls_schema(tools: list[dict], choice, parallel: bool = True) -> dict:
    """The JSON schema an output must satisfy when ``tool_choice`` (``"required"`` or ``{"type": "function",
    "function": {"name": ...}}``) forces calls: a list of ``{"name", "parameters"}`` items over ``tools`` (one item
    at most without ``parallel``), or the named function's parameters.

    Raises:
        ValueError: a named function that is not among ``tools``.
    """
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise ValueError(f"`tool_choice` names the function {name!r}, which is not among `tools` "
                             f"{sorted(functions)}")  # fmt: skip
        return functions[name]
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
              "required": ["name", "parameters"]} for name, parameters in functions.items()]  # fmt: skip
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls or None, the calls); no calls: ``(text, [])``."""
    if parser == FORCED:
        items = _loads(text)
        if not isinstance(items, list):
            return text, []
        return _result(text, "", [_call(item, "parameters", "arguments") for item in items])
    if parser.startswith(_NAMED):
        arguments = _loads(text)
        if not isinstance(arguments, dict):
            return text, []
        return _result(text, "", [_call({"name": parser[len(_NAMED) :], "arguments": arguments}, "arguments")])
    if parser == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [_call(_loads(body), "arguments") for body in _HERMES_CALL.findall(text[start:])]
        return _result(text, text[:start], calls)
    if parser == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        body = _loads(text[start + len("[TOOL_CALLS]") :])
        items = body if isinstance(body, list) else [body]
        return _result(text, text[:start], [_call(item, "arguments") for item in items])
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        return _result(text, "", [_call(_loads(part), "parameters", "arguments") for part in _split_json(body)])
    raise ValueError(f"`parser` must be one of {[*PARSERS, FORCED]} or named_parser(name), got {parser!r}")


class ToolCallStream:
    """A stream's text with the calls held back: ``feed`` gives the text to send now, ``finish`` what is left and
    the calls. Text is sent until an opener (or what may be the start of one) appears; from there it waits."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.holding = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding or self.parser == FORCED or self.parser.startswith(_NAMED):  # the whole output is calls
            return ""
        if self.parser == "llama3_json":  # a call is the whole answer: only its very start can open one
            head = self.text.lstrip()
            if not head or "<|python_tag|>".startswith(head):
                return ""  # too early to tell
            if head.startswith(("{", "<|python_tag|>")):
                self.holding = True
                return ""
            return self._send(len(self.text))
        openers = _OPENERS[self.parser]
        found = min((i for i in (self.text.find(o, self.sent) for o in openers) if i >= 0), default=-1)
        if found >= 0:
            self.holding = True
            return self._send(found)
        return self._send(len(self.text) - _partial_opener(self.text, openers))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls)."""
        _, calls = parse_tool_calls(self.parser, self.text)
        if not calls:
            return self.text[self.sent :], []
        if self.parser not in _OPENERS:  # forced calls: no text around them
            return "", calls
        start = 0 if self.parser == "llama3_json" else self.text.find(_OPENERS[self.parser][0])
        return self.text[self.sent : max(start, self.sent)].rstrip(), calls

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


def _partial_opener(text: str, openers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could start an opener (held back until the next delta)."""
    longest = 0
    for opener in openers:
        for n in range(min(len(opener) - 1, len(text)), 0, -1):
            if opener.startswith(text[-n:]):
                longest = max(longest, n)
                break
    return longest


def _loads(text: str):
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _split_json(body: str) -> list[str]:
    """``{...}; {...}`` into its objects (Llama 3's parallel calls), by brace depth outside strings."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(body[start : i + 1])
                start = i + 1
        elif depth == 0 and ch not in " \n\t;":
            return [body]  # text after the calls: not a call answer
    return parts if depth == 0 else [body]


def _call(obj, *argument_keys: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def _result(text: str, before: str, calls: list[ToolCall | None]) -> tuple[str | None, list[ToolCall]]:
    if not calls or any(c is None for c in calls):
        return text, []
    content = before.strip()
    return (content or None), list(calls)
