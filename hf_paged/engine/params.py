"""SamplingParams: how one request decodes (vLLM's fields under hf_paged's names).

Validated once in ``__post_init__``, so a bad value fails at submission with a message that names the
field, the value and the allowed range, never mid-generation. Pure Python: no torch import.
"""

import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's default cap)
MIN_TEMPERATURE = 1e-2  # smallest non-zero temperature (vLLM's clamp); below it use 0.0 (greedy)
MAX_PENALTY = 2.0  # presence/frequency penalties live in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a float, got {value!r} ({type(value).__name__})")
    return float(value)


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (constrained decoding): set exactly one field.

    The engine compiles it into a token mask with xgrammar (hf_paged.engine.structured; ``pip install
    'hf_paged[structured]'``): at every step the tokens that cannot continue a valid output get -inf before
    sampling, and the output ends (finish_reason "stop") once it is complete and the model picks EOS.

    Attributes:
        json: A JSON schema, as a dict or its JSON text. The output is compact JSON that satisfies it
            (separators ``", "`` and ``": "``, no other whitespace; properties in the schema's order; no
            property the schema does not name).
        json_object: Any JSON object.
        regex: A regular expression the whole output matches (xgrammar's regex syntax: ECMAScript-like).
        choice: One of these strings, exactly (a list or tuple of non-empty strings; stored as a tuple).
        grammar: An EBNF grammar in xgrammar's syntax (llama.cpp's GBNF) whose rule ``root`` the output matches.

    Raises:
        ValueError: If not exactly one field is set, ``json`` text is not JSON, or ``choice`` is empty or holds
            an empty string.
        TypeError: If a field has the wrong type.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"`json` must be a JSON schema (a dict or its JSON text), got text that is "
                                     f"not JSON ({e}): {self.json[:200]!r}") from None  # fmt: skip
            elif isinstance(self.json, dict):
                schema = self.json
            else:
                raise TypeError(f"`json` must be a JSON schema as a dict or a str, got {type(self.json).__name__}")
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"`json` must be a JSON schema: an object (or true/false), got {schema!r:.200}")
        _as_bool("json_object", self.json_object)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"`{name}` must be a str, got {type(value).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Iterable):
                raise TypeError(f"`choice` must be a list or tuple of str, got {self.choice!r:.200}")
            choice = tuple(self.choice)
            bad = next((c for c in choice if not isinstance(c, str)), None)
            if bad is not None:
                raise TypeError(f"`choice` must hold only str, got {bad!r} ({type(bad).__name__})")
            if not choice or not all(choice):
                raise ValueError(f"`choice` must be a non-empty list of non-empty strings, got {list(choice)}")
            object.__setattr__(self, "choice", choice)  # frozen: the normalised tuple replaces the list
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutput takes exactly one of json, json_object, regex, choice, grammar; got "
                f"{', '.join(given) if given else 'none'}"
            )

    @property
    def kind(self) -> str:
        """The field that is set: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @property
    def key(self) -> tuple:
        """A hashable key equal for equal constraints (a schema dict and its JSON text compare equal): the engine
        compiles each distinct key once."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, sort_keys=True)
        if kind == "json_object":
            return (kind,)
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    """How one request decodes. Treat as immutable once built (it is validated only at construction).

    Sampling (``beam_width == 1``) processes the logits in the order of ``Sampler``'s pipeline:
    penalties, ``min_tokens``, then temperature, top-k, top-p, min-p, and samples. Beam search
    (``beam_width > 1``) keeps the ``beam_width`` best hypotheses by cumulative log-prob; it ignores
    ``temperature`` and ``seed`` and needs every other sampling field at its default; it takes no ``stop``
    strings and no ``logprobs``.

    Attributes:
        n: Parallel samples returned per prompt, >= 1. With beam search, the ``n`` best of the
            ``beam_width`` beams (so ``n <= beam_width``).
        beam_width: Beams kept per prompt; 1 = sampling, > 1 = beam search.
        max_new_tokens: Most tokens to generate, >= 1.
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens are generated;
            in [0, max_new_tokens].
        temperature: 0.0 = greedy (argmax); else >= ``MIN_TEMPERATURE``. Ignored by beam search.
        top_k: Keep the k most likely tokens; 0 = off, else >= 1 (1 = greedy).
        top_p: Keep the smallest set of most likely tokens whose probability reaches ``top_p``; in (0, 1],
            1 = off.
        min_p: Drop tokens less likely than ``min_p`` times the most likely one; in [0, 1], 0 = off.
        seed: Seeds this request's own generator, so its samples do not depend on the rest of the batch;
            in [0, 2**64). None = the global RNG.
        repetition_penalty: > 0, 1 = off. HF/vLLM semantics over prompt + output tokens: a seen token's
            logit is divided by it when positive and multiplied by it when negative.
        presence_penalty: In [-2, 2]. OpenAI/vLLM semantics over output tokens only:
            ``logit -= presence_penalty * (count > 0)``.
        frequency_penalty: In [-2, 2]. Over output tokens only: ``logit -= frequency_penalty * count``.
        stop_token_ids: Token ids (besides EOS) that end the sequence; the token is kept in the output.
        stop: Stop strings (a str or a list of them; stored as a tuple); the text ends before the match
            unless ``include_stop_str_in_output``.
        ignore_eos: Keep generating past EOS (benchmarks). ``min_tokens`` masks EOS either way.
        logprobs: None = no log-probs; k in [0, 20] = the sampled token's log-prob plus the k most likely
            alternatives, all under the raw model distribution (before penalties and temperature; after the
            ``structured_output`` mask, which gives the tokens it rules out -inf).
        prompt_logprobs: None = none; k in [0, 20] = for every prompt token after the first, its log-prob given the
            tokens before it plus the k most likely alternatives there, under the raw model distribution
            (``RequestOutput.prompt_logprobs``). Such a request's prompt is computed in full: it takes no prefix-cache
            hits until its prompt log-probs are known.
        length_penalty: Beam scoring as in HF: ``score = sum_logprobs / num_tokens ** length_penalty``;
            > 0 favours longer beams, < 0 shorter ones.
        skip_special_tokens: Drop special tokens from the detokenized text.
        include_stop_str_in_output: Keep the matched stop string at the end of the text.
        structured_output: A ``StructuredOutput`` the output must follow (constrained decoding), or None.
            Not with beam search, and not with ``min_tokens`` (which could mask the only token a complete
            output allows: EOS). With it, ``logprobs`` are those of the masked distribution (as vLLM), and
            ``ignore_eos`` does not extend an output the grammar has ended.
    """

    n: int = 1
    beam_width: int = 1
    max_new_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"`n` must be >= 1, got {self.n}")
        self.beam_width = _as_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"`beam_width` must be >= 1 (1 = sampling, > 1 = beam search), got {self.beam_width}")
        self.max_new_tokens = _as_int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"`min_tokens` must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}"
            )

        self.temperature = _as_float("temperature", self.temperature)
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"`temperature` must be 0.0 (greedy) or in [{MIN_TEMPERATURE}, inf), got {self.temperature}"
            )
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"`top_k` must be 0 (off) or >= 1, got {self.top_k}")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"`min_p` must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if not 0 <= self.seed < 2**64:
                raise ValueError(f"`seed` must be None or in [0, 2**64), got {self.seed}")

        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"`repetition_penalty` must be in (0, inf) (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"`{name}` must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
            setattr(self, name, value)

        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        self.stop = self._normalize_stop(self.stop)
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _as_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"`{name}` must be None or in [0, {MAX_LOGPROBS}], got {value}")
                setattr(self, name, value)
        self.length_penalty = _as_float("length_penalty", self.length_penalty)
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"`length_penalty` must be finite, got {self.length_penalty}")
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _as_bool("include_stop_str_in_output", self.include_stop_str_in_output)

        if self.structured_output is not None:
            self._check_structured_output()
        if self.beam_width > 1:
            self._check_beam_search()

    def _check_structured_output(self) -> None:
        if not isinstance(self.structured_output, StructuredOutput):
            raise TypeError(
                "`structured_output` must be a StructuredOutput (hf_paged.StructuredOutput) or None, got "
                f"{type(self.structured_output).__name__}"
            )
        if self.beam_width > 1:
            raise ValueError(
                f"`structured_output` is not supported with beam search (beam_width={self.beam_width}); use "
                "sampling (beam_width=1), with n > 1 for several outputs"
            )
        if self.min_tokens:
            raise ValueError(
                f"`min_tokens` must be 0 with `structured_output`, got {self.min_tokens}: the grammar decides where "
                "the output ends, and masking EOS could leave a complete output no token to pick"
            )

    def _check_beam_search(self) -> None:
        if self.n > self.beam_width:
            raise ValueError(f"`n` must be in [1, beam_width={self.beam_width}] with beam search, got {self.n}")
        # Beams are ranked by the model's log-probs (hf_paged.engine.beam_search), never sampled or penalised,
        # so a non-default value here would be silently ignored: refuse it instead.
        defaults = {
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                raise ValueError(
                    f"`{name}` must be {default} (its default) with beam search (beam_width={self.beam_width}), "
                    f"got {value}; beams are ranked by log-prob, not sampled"
                )
        # Beam hypotheses end on tokens (EOS, stop_token_ids, the length); their text is made once they end.
        if self.stop:
            raise ValueError(
                f"`stop` strings are not supported with beam search (beam_width={self.beam_width}), got {self.stop}; "
                "use stop_token_ids, or sampling (beam_width=1)"
            )
        if self.logprobs is not None:
            raise ValueError(
                f"`logprobs` must be None with beam search (beam_width={self.beam_width}), got {self.logprobs}; "
                "each output's cumulative_logprob is its beam score's log-prob sum"
            )

    @staticmethod
    def _normalize_stop_token_ids(value: object) -> tuple[int, ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise TypeError(f"`stop_token_ids` must be a list or tuple of ints, got {value!r}")
        token_ids = tuple(_as_int("stop_token_ids", token_id) for token_id in value)
        negative = [token_id for token_id in token_ids if token_id < 0]
        if negative:
            raise ValueError(f"`stop_token_ids` must be token ids >= 0, got {negative[0]} in {token_ids}")
        return token_ids

    @staticmethod
    def _normalize_stop(value: object) -> tuple[str, ...]:
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, Iterable):
            raise TypeError(f"`stop` must be a str or a list of str, got {value!r}")
        stop = tuple(value)
        for text in stop:
            if not isinstance(text, str):
                raise TypeError(f"`stop` must be a str or a list of str, got {text!r} ({type(text).__name__})")
            if not text:
                raise ValueError(f"`stop` strings must be non-empty, got {stop}")
        return stop

    @property
    def is_greedy(self) -> bool:
        """Whether sampling reduces to argmax (temperature 0 or top-k 1)."""
        return self.temperature == 0.0 or self.top_k == 1
