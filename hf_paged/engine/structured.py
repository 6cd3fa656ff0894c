"""Structured outputs (constrained decoding) for ContinuousBatcher on xgrammar; ``model.generate``: grammar_processor.

A request's ``StructuredOutput`` (hf_paged.engine.params) becomes a grammar over the tokenizer's vocabulary; each of
its sequences keeps a ``GrammarMatcher`` that has read the sequence's output; before sampling, the tokens that
cannot continue a valid output get -inf. In order, for one request:

1. ``add_request``: the spec is parsed into an ``xgrammar.Grammar`` on the caller's thread (milliseconds), so an
   invalid schema, regex or grammar is a ``ValueError`` there, as vLLM refuses it with a 400 before queueing it.
   A request without a tokenizer, with beam search, or without xgrammar installed is refused the same way.
2. The grammar is compiled against the vocabulary (the token-mask tables: the expensive part) on a worker thread,
   once per distinct spec (``GrammarCache``). Until it is ready the request waits outside the scheduler; the other
   requests run on. A compile that still fails ends the request with finish_reason "abort" and a logged error.
3. Each step with constrained rows: each row's matcher reads the token just read back, then a worker thread fills
   the rows of a token bitmask while the device runs the forward and the step loop makes text and schedules the
   next step; the mask then goes up (hf_paged.engine.bitmask) and is applied to those rows of the logits in one
   launch (xgrammar's kernel: Triton on CUDA, C++ on the CPU), before the sampler, outside the CUDA graphs
   (hf_paged.engine.grammar_masks). Steps without constrained rows do no mask work.
4. The output ends with finish_reason "stop" when the model picks EOS (allowed only once the output is complete)
   or the matcher terminates.

A sequence's matcher is derived from its tokens, never the other way round: ``SeqMatcher.sync`` feeds it the
output tokens it has not read, and rebuilds it by replay when the output got shorter (a failed step). So a fork
(``n`` > 1: the samples fork after the prompt, with no output yet), a preemption by recompute or swap (the tokens
do not change) and a recovered step need no grammar bookkeeping of their own.

Async scheduling: a constrained row's mask needs the token sampled just before it on the host. Steps stay deferred;
a step with constrained rows reads the previous step's tokens back once its own forward is queued and starts its
masks; its sampling is queued by the next step, once that step is scheduled and before its forward
(``StepPipeline``). A row whose sequence has ended by then gets no mask (its token is dropped).
"""

import collections
import json
import logging
import os
import re
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from hf_paged.engine.bitmask import import_xgrammar
from hf_paged.engine.grammar_masks import MaskFiller, SeqMatcher
from hf_paged.engine.params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from hf_paged.engine.request import Request, Sequence

logger = logging.getLogger(__name__)

_XGR_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")  # "[14:00:04] /project/cpp/file.cc:94: " on C++ errors
_NUM_WORKERS = 4  # compile threads of an engine
_IDLE_WAIT_S = 0.1  # longest wait for a compile when nothing else can run (aborts are applied in between)


def choice_ebnf(choice: tuple[str, ...]) -> str:
    """An EBNF grammar whose root is exactly one of ``choice`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def parse_grammar(spec: StructuredOutput):
    """``spec`` as an ``xgrammar.Grammar`` (parsing only: no vocabulary work).

    JSON is compact (``any_whitespace=False``): free whitespace lets a model, small ones above all, emit
    whitespace without end (xgrammar's docs and vLLM's ``disable-any-whitespace`` option).

    Raises:
        ValueError: xgrammar is missing, or the schema, regex or grammar is invalid (the message names the field).
    """
    xgr = import_xgrammar()
    kind = spec.kind
    try:
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return _strict_strings(xgr, xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        if kind == "json_object":
            return _strict_strings(xgr, xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        message = _XGR_LOCATION.sub("", str(e)).strip()
        value = getattr(spec, kind)
        raise ValueError(f"`structured_output.{kind}` is invalid: {message} (got {value!r:.300})") from None


# The characters of JSON strings, as xgrammar (0.2.x) writes them, let two kinds of bytes through that make invalid
# output: a length-bounded string (minLength/maxLength) takes [^"\\\r\n], so raw control characters (U+0000-U+001F,
# which JSON forbids in strings: json.loads, pydantic and the openai client refuse them); and every string class takes
# UTF-8-encoded surrogates (ED A0-BF xx, not UTF-8: they decode to three U+FFFD, past a maxLength). Random-weight
# models emit both. Each class is rewritten to the strict one; a grammar without them is returned unchanged.
_STRING_CHAR_CLASSES = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]", r"[^\0-\x1f\"\\]")
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def _strict_strings(xgr, grammar):
    text = str(grammar)
    strict = text
    for loose in _STRING_CHAR_CLASSES:
        strict = strict.replace(loose, _STRICT_STRING_CHAR)
    return grammar if strict == text else xgr.Grammar.from_ebnf(strict)


def grammar_vocab_size(tokenizer, vocab_size: int, stop_token_ids) -> int:
    """How many ids the grammars know: the tokenizer's (its largest id + 1) and the stop ids, within the logits'
    width ``vocab_size``.

    Logits are often wider than the tokenizer (padded to a multiple of 64 or 128, or a head shared by several
    vocabularies). xgrammar counts every id past the tokenizer as a special token and pays for each one at every
    accepted token (~20 µs a token with 100k of them, against ~1 µs without): those ids are left out of the
    grammars and masked apart (``apply_bitmask``).
    """
    top = max(max(tokenizer.get_vocab().values(), default=-1), max(stop_token_ids, default=-1)) + 1
    return min(vocab_size, top)


class GrammarCache:
    """Compiled grammars by spec key, compiled on worker threads; the ``max_entries`` most recent are kept.

    A ``Future`` stands for each compile, so requests with the same spec share one compile even while it runs. The
    xgrammar compiler (its ``TokenizerInfo`` reads the whole vocabulary: ~0.5 s for 49k tokens) is built by the
    first compile, on a worker. With ``blocking`` every compile finishes inside ``get`` (tensor parallelism:
    every rank must admit a request in the same step).

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (the bitmask covers it; ids past the tokenizer's are masked).
        stop_token_ids: the engine's EOS ids: the tokens a complete output may end with.
        max_entries: compiled grammars kept after their requests are done.
        blocking: compile inside ``get``.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_entries: int = 128, blocking: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids) or None  # None: xgrammar takes the tokenizer's EOS
        self.max_entries = max_entries
        self.blocking = blocking
        self._compiler = None  # xgrammar.GrammarCompiler, made by the first compile
        self._compiler_lock = threading.Lock()
        self._futures: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        # A few workers, so that one slow grammar does not hold up the others' compiles. Threads start on demand and
        # end once the engine (and so this cache) is garbage-collected.
        self._executor = ThreadPoolExecutor(max_workers=_NUM_WORKERS, thread_name_prefix="hf-paged-grammar")

    def get(self, spec: StructuredOutput) -> Future:
        """The compile of ``spec`` (started now unless an equal spec's is cached or running).

        Raises:
            ValueError: as ``parse_grammar``; nothing is cached then.
        """
        key = spec.key
        future = self._futures.get(key)
        if future is None:
            grammar = parse_grammar(spec)
            future = self._executor.submit(self._compile, grammar)
            self._futures[key] = future
            while len(self._futures) > self.max_entries:
                self._futures.popitem(last=False)  # requests using it hold their own reference
        else:
            self._futures.move_to_end(key)
        if self.blocking:
            wait_futures([future])
        return future

    def _compile(self, grammar):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)  # fmt: skip
                # Few threads: the compile shares the host with the step loop that feeds the device.
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(4, os.cpu_count() or 1),
                                                     cache_enabled=False)  # fmt: skip
        return self._compiler.compile_grammar(grammar)


class RequestGrammar:
    """A request's compiled grammar (``future``) and its spec."""

    def __init__(self, spec: StructuredOutput, future: Future):
        self.spec = spec
        self.future = future
        self.compiled = None  # xgrammar.CompiledGrammar once the future is done

    @property
    def is_ready(self) -> bool:
        return self.future.done()

    def new_matcher(self):
        if self.compiled is None:
            self.compiled = self.future.result()
        return import_xgrammar().GrammarMatcher(self.compiled)


class StructuredDecoding:
    """The engine's structured outputs: requests waiting for their grammar, the step's masks, matcher advances.

    Nothing here runs for a request without ``structured_output``; xgrammar is imported by the first one.

    Args:
        tokenizer: the engine's tokenizer (None: structured requests are refused).
        vocab_size: the model's logits width.
        stop_token_ids: the engine's EOS ids.
        blocking: compile at submission (tensor parallelism; see ``GrammarCache``).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, blocking: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.blocking = blocking
        self.cache: GrammarCache | None = None
        self.waiting: list[Request] = []  # submitted, grammar compiling: not in the scheduler yet (arrival order)
        self.masks = MaskFiller(vocab_size)  # a step's masks (hf_paged.engine.grammar_masks)
        self.grammar_vocab = vocab_size  # the ids the grammars know (grammar_vocab_size), set with the cache

    def grammar_for(self, params: SamplingParams) -> RequestGrammar | None:
        """The grammar of a request with these parameters (None without ``structured_output``).

        Raises:
            ValueError: no tokenizer, xgrammar missing, or an invalid schema, regex or grammar.
        """
        spec = params.structured_output
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError(
                "`structured_output` needs a tokenizer (the grammar is matched against token texts): "
                "ContinuousBatcher(model, tokenizer=...)"
            )
        if self.cache is None:
            import_xgrammar()
            self.grammar_vocab = grammar_vocab_size(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self.cache = GrammarCache(self.tokenizer, self.grammar_vocab, self.stop_token_ids, blocking=self.blocking)
        return RequestGrammar(spec, self.cache.get(spec))

    def has_waiting(self) -> bool:
        """Whether a request still waits for its grammar (read-only: safe from another thread)."""
        return any(not request.is_finished for request in self.waiting)

    def hold(self, request: "Request") -> bool:
        """Keep ``request`` back while its grammar compiles (or until ``release`` ends it, if the compile failed);
        False when it can be scheduled now."""
        grammar = request.grammar
        if grammar is None or (grammar.is_ready and grammar.future.exception() is None):
            return False
        self.waiting.append(request)
        return True

    def release(self, add, idle: bool) -> list["Request"]:
        """Hand the requests whose grammar is ready to ``add`` (``Scheduler.add``), in arrival order.

        Args:
            add: called with each request to schedule.
            idle: nothing else can run: wait a little for a compile instead of spinning.

        Returns:
            The requests whose compile failed (the caller ends them). Finished ones (aborted) are dropped.
        """
        if idle and not any(r.grammar.is_ready for r in self.waiting):
            wait_futures([r.grammar.future for r in self.waiting], timeout=_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        failed, still = [], []
        for request in self.waiting:
            if request.is_finished:
                continue
            if not request.grammar.is_ready:
                still.append(request)
            elif request.grammar.future.exception() is not None:
                error = request.grammar.future.exception()
                logger.error("request %s: structured_output could not be compiled: %s", request.request_id, error)
                failed.append(request)
            else:
                add(request)
        self.waiting = still
        return failed

    def advance(self, request: "Request", seq: "Sequence") -> str | None:
        """Feed ``seq``'s new tokens to its matcher; how the sequence must end, if it must.

        Returns:
            None to go on; "stop" when the grammar has terminated (it accepted EOS: with ``ignore_eos`` the
            scheduler does not end the sequence on EOS, the grammar does); "abort" when the grammar refused a
            token (never with the mask applied; logged as an error).
        """
        if seq.finish_reason is not None:
            seq.grammar_state = None  # nothing more to match: the matcher's memory goes
            return None
        if seq.grammar_state is None and len(seq.token_ids) - seq.num_inflight == seq.num_prompt_tokens:
            return None  # no output to read (say, a request still waiting for its grammar, after a failed step)
        state = SeqMatcher.sync(request, seq)
        if state.rejected is not None:
            logger.error("request %s: the sampled token %d does not follow its structured_output; the sequence is "
                         "ended", request.request_id, state.rejected)  # fmt: skip
            return "abort"
        return "stop" if state.matcher.is_terminated() else None
