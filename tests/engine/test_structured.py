"""Structured outputs in ContinuousBatcher: every constrained output parses, whatever the engine does around it.

A tiny random Llama (logits 128 wide) with a one-character-per-token tokenizer of printable ASCII (98 tokens: the
ids past it are padding the mask must rule out). Random weights make the model pick any token the grammar allows,
so the schemas, regexes and grammars below describe finite languages: every output ends within ``MAX_NEW`` tokens,
and each must parse and match. Every test runs with async scheduling off and on.
"""

import asyncio
import json
import logging
import re
import sys
import threading

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, ascii_tokenizer, tiny_model

from hf_paged import ContinuousBatcher, SamplingParams, StructuredOutput
from hf_paged.engine import grammar_masks, structured
from hf_paged.engine.bitmask import apply_bitmask

MAX_NEW = 120
VOCAB = 128
EOS = 2
_ASYNC = {"on": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def scheduling_mode(request):
    _ASYNC["on"] = request.param
    yield request.param


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", device=DEVICE, vocab_size=VOCAB, eos_token_id=EOS)


@pytest.fixture(scope="module")
def tokenizer():
    return ascii_tokenizer()


def make_engine(model, tokenizer, **kwargs) -> ContinuousBatcher:
    settings = dict(num_blocks=64, block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    return ContinuousBatcher(model, tokenizer, **{**settings, "async_scheduling": _ASYNC["on"], **kwargs})


def validate(value, schema: dict, path: str = "$") -> None:
    """The JSON-schema subset the tests use: type, enum, properties, required, additionalProperties, items,
    minItems, maxItems, minLength, maxLength, minimum, maximum."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (path, value)
    elif kind is not None:
        assert isinstance(value, types[kind]), (path, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if "minimum" in schema:
        assert value >= schema["minimum"], (path, value)
    if "maximum" in schema:
        assert value <= schema["maximum"], (path, value)
    if "minLength" in schema or "maxLength" in schema:
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30), (path, value)
    if kind == "object":
        properties = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), (path, value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(properties), (path, value)
        for name, item in value.items():
            if name in properties:
                validate(item, properties[name], f"{path}.{name}")
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), (path, value)
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")


SHORT = {"type": "string", "maxLength": 4}
PERSON = {
    "type": "object",
    "properties": {
        "name": SHORT,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
}
NESTED = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "email": SHORT},
            "required": ["id"],
            "additionalProperties": False,
        },  # fmt: skip
    },
    "required": ["tags", "owner"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICE = ("yes", "no", "maybe so")
GRAMMAR = r"""root ::= expr
expr ::= term (("+" | "-") term)?
term ::= num | "(" num "*" num ")"
num ::= [1-9] [0-9]?
"""
GRAMMAR_RE = r"(\d{1,2}|\(\d{1,2}\*\d{1,2}\))([+-](\d{1,2}|\(\d{1,2}\*\d{1,2}\)))?"


def check(spec: StructuredOutput, text: str) -> None:
    """``text`` is a complete output of ``spec``."""
    if spec.json is not None:
        validate(json.loads(text), spec.json if isinstance(spec.json, dict) else json.loads(spec.json))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


SPECS = {
    "json-required-enum": StructuredOutput(json=PERSON),
    "json-nested-array": StructuredOutput(json=json.dumps(NESTED)),  # the schema as JSON text
    "json-object": StructuredOutput(json_object=True),
    "regex-date": StructuredOutput(regex=DATE),
    "regex-phone": StructuredOutput(regex=PHONE),
    "choice": StructuredOutput(choice=list(CHOICE)),
    "grammar": StructuredOutput(grammar=GRAMMAR),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_output_parses_greedy_and_sampled_with_n(model, tokenizer, name):
    spec = SPECS[name]
    engine = make_engine(model, tokenizer)
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, structured_output=spec),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7, n=3, structured_output=spec),
    ]
    outs = engine.generate(["Give me data: ", "Answer now!"], params, use_tqdm=False)
    for completion in [c for o in outs for c in o.outputs]:
        if spec.json_object and completion.finish_reason == "length":  # any object: unbounded, so cut at times
            continue
        assert completion.finish_reason == "stop", completion
        assert completion.token_ids[-1] == EOS  # it ended on EOS, which the grammar allowed only once complete
        check(spec, completion.text)
    # The n samples forked and went their own ways; not checked where a few short outputs are all there is ("{}"
    # for any object, three words for the choice), which n = 3 samples of a random model often repeat.
    if not spec.json_object and spec.choice is None:
        assert len({c.text for c in outs[1].outputs}) > 1
    assert_engine_drained(engine)


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(model, tokenizer, monkeypatch):
    """Unconstrained outputs equal a run without constrained requests; masks touch only constrained rows, and a
    step without one does no mask work."""
    calls = []
    start = grammar_masks.MaskFiller.start

    def recording(self, logits, seqs, requests, rows, *args):
        calls.append((rows, [i for i, r in enumerate(requests) if r.grammar is not None]))
        return start(self, logits, seqs, requests, rows, *args)

    monkeypatch.setattr(grammar_masks.MaskFiller, "start", recording)
    prompts = ["abc", "hello world", "xyz" * 5]
    plain = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    alone = make_engine(model, tokenizer).generate(prompts, plain, use_tqdm=False)
    assert not calls
    engine = make_engine(model, tokenizer)
    mixed = engine.generate(
        prompts + ["data: ", "date: "],
        [plain] * 3
        + [
            SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=1, structured_output=SPECS[k])
            for k in ("json-required-enum", "regex-date")
        ],  # fmt: skip
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert calls and all(rows == constrained for rows, constrained in calls)
    assert len(calls) <= engine.metrics().num_steps
    check(SPECS["json-required-enum"], mixed[3].outputs[0].text)
    check(SPECS["regex-date"], mixed[4].outputs[0].text)
    assert_engine_drained(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_valid_and_equal(model, tokenizer, mode):
    """A pool too small for all of them: requests are preempted mid-output, resumed, and end as a roomy run."""
    prompts = [f"req {i}: " + "x" * i for i in range(6)]
    params = [
        SamplingParams(max_new_tokens=72, temperature=0.0, structured_output=SPECS[k])
        for k in (
            "json-required-enum",
            "json-nested-array",
            "regex-phone",
            "grammar",
            "json-required-enum",
            "json-nested-array",
        )
    ]
    roomy = make_engine(model, tokenizer).generate(prompts, params, use_tqdm=False)
    engine = make_engine(model, tokenizer, num_blocks=12, max_num_batched_tokens=32, preemption_mode=mode,
                         swap_space_gb=0.01)  # fmt: skip
    tight = engine.generate(prompts, params, use_tqdm=False)
    assert engine.metrics().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    for out, p in zip(tight, params, strict=True):
        check(p.structured_output, out.outputs[0].text)
    assert_engine_drained(engine)


def test_prefix_cache_hits_and_stop_strings(model, tokenizer):
    engine = make_engine(model, tokenizer)
    system = "You are a JSON API. Reply with the record. " * 2  # > 8 blocks of 8 tokens: prefix hits
    spec = StructuredOutput(json=PERSON)
    first = engine.generate([system + "one"], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                             structured_output=spec), use_tqdm=False)  # fmt: skip
    second = engine.generate([system + "two"], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                              structured_output=spec), use_tqdm=False)  # fmt: skip
    assert second[0].num_cached_tokens >= 64
    for out in first + second:
        check(spec, out.outputs[0].text)
    # A stop string cuts the (valid) output where it appears: the text ends before it.
    text = first[0].outputs[0].text
    stopped = engine.generate([system + "one"], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop='"age"',
                                                               structured_output=spec), use_tqdm=False)  # fmt: skip
    completion = stopped[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", '"age"')
    assert completion.text == text[: text.index('"age"')]
    assert_engine_drained(engine)


def test_logprobs_are_of_the_masked_distribution(model, tokenizer):
    engine = make_engine(model, tokenizer)
    spec = StructuredOutput(choice=["yes", "no"])
    (out,) = engine.generate(["?"], SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, logprobs=5,
                                                   structured_output=spec), use_tqdm=False)  # fmt: skip
    completion = out.outputs[0]
    first = completion.logprobs[0]  # {token id: logprob}: only "y" and "n" can start the output
    finite = {t: lp for t, lp in first.items() if lp > float("-inf")}
    assert set(finite) == set(tokenizer.convert_tokens_to_ids(["y", "n"]))
    assert abs(sum(2.718281828459045**lp for lp in finite.values()) - 1.0) < 1e-4  # all the masked mass
    last = completion.logprobs[-1]  # EOS after a complete "yes"/"no": the only choice left
    assert abs(last[EOS]) < 1e-5
    assert_engine_drained(engine)


def test_abort_and_stream(model, tokenizer):
    engine = make_engine(model, tokenizer)
    spec = StructuredOutput(json=NESTED)
    rid = engine.add_request("abort me", SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                        structured_output=spec))  # fmt: skip
    for _ in range(4):
        engine.step()
    engine.abort(rid)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == rid] == ["abort"]
    stream = engine.stream("stream me", SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                       structured_output=spec))  # fmt: skip
    deltas = list(stream)
    assert deltas[-1].finish_reason == "stop"
    check(spec, "".join(d.text for d in deltas))
    half = engine.stream("leave early", SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                       structured_output=spec))  # fmt: skip
    next(half), next(half)
    half.close()  # aborts the request
    assert_engine_drained(engine)


def test_ignore_eos_ends_when_the_grammar_does(model, tokenizer):
    engine = make_engine(model, tokenizer)
    (out,) = engine.generate(["x"], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                                   structured_output=SPECS["regex-date"]), use_tqdm=False)  # fmt: skip
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == EOS
    check(SPECS["regex-date"], completion.text)
    assert_engine_drained(engine)


def test_a_refused_token_ends_only_its_sequence(model, tokenizer, monkeypatch, caplog):
    """A token the grammar refuses (the masks are not applied here, so the model picks freely) ends its sequence
    with "abort" and an error in the log, in whichever step finds it; the plain request beside it runs on."""
    monkeypatch.setattr(grammar_masks, "apply_bitmask", lambda *args: None)
    plain = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    (alone,) = make_engine(model, tokenizer).generate(["go on"], plain, use_tqdm=False)
    engine = make_engine(model, tokenizer)
    constrained = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, structured_output=SPECS["regex-date"])
    with caplog.at_level(logging.ERROR):
        outs = engine.generate(["go on", "date: "], [plain, constrained], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "abort"
    assert "does not follow its structured_output" in caplog.text
    assert_engine_drained(engine)


def test_a_step_failing_while_masks_fill_recovers(model, tokenizer, monkeypatch):
    """A step that fails while the worker fills the step before's masks (here: its schedule, once) leaves the engine
    consistent: the requests are requeued, their matchers go on from their tokens, and the outputs equal an
    undisturbed run's, with no block left behind."""
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, structured_output=SPECS[k])
              for k in ("json-required-enum", "regex-date", "grammar")]  # fmt: skip
    prompts = [f"item {i}: " for i in range(len(params))]
    expected = make_engine(model, tokenizer).generate(prompts, params, use_tqdm=False)
    engine = make_engine(model, tokenizer)
    schedule, calls = engine.scheduler.schedule, [0]

    def flaky():
        calls[0] += 1
        if calls[0] == 6:  # a few tokens into the outputs
            raise RuntimeError("injected")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", flaky)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = {}
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[rid].outputs[0].token_ids for rid in ids] == [o.outputs[0].token_ids for o in expected]
    for rid, spec in zip(ids, params, strict=True):
        check(spec.structured_output, outs[rid].outputs[0].text)
    assert_engine_drained(engine)


def test_invalid_specs_fail_only_their_request(model, tokenizer):
    engine = make_engine(model, tokenizer)
    rid = engine.add_request("fine", SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                    structured_output=SPECS["regex-date"]))  # fmt: skip
    engine.step()
    bad = [
        (StructuredOutput(regex="[a-"), r"structured_output\.regex` is invalid: .*Unclosed"),
        (StructuredOutput(json={"type": "frob"}), r"structured_output\.json` is invalid: .*frob"),
        (StructuredOutput(grammar='root ::= "a" rest'), r"structured_output\.grammar` is invalid: .*rest"),
    ]
    for spec, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", SamplingParams(structured_output=spec))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert list(outs) == [rid]
    check(SPECS["regex-date"], outs[rid].outputs[0].text)
    assert_engine_drained(engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_masks_only_the_given_rows(dtype):
    logits = torch.randn(3, 70).to(dtype)
    bitmask = torch.zeros(3, 3, dtype=torch.int32)  # [rows, ceil(70 / 32)]
    bitmask[1, 0] = 0b1010  # row 1 keeps tokens 1 and 3
    bitmask[2] = -1  # row 2 keeps everything
    expected = logits.clone()
    expected[1] = float("-inf")
    expected[1, [1, 3]] = logits[1, [1, 3]]
    apply_bitmask(logits, bitmask, 70, [1, 2])
    torch.testing.assert_close(logits, expected)


def test_refusals(model, tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="exactly one of .* got regex, choice"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutput()
    with pytest.raises(ValueError, match="`json` must be a JSON schema .* not JSON"):
        StructuredOutput(json="{oops")
    with pytest.raises(ValueError, match="`choice` must be a non-empty list"):
        StructuredOutput(choice=["a", ""])
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(beam_width=2, structured_output=SPECS["choice"])
    with pytest.raises(ValueError, match="`min_tokens` must be 0 with `structured_output`"):
        SamplingParams(min_tokens=2, max_new_tokens=4, structured_output=SPECS["choice"])
    with pytest.raises(TypeError, match="must be a StructuredOutput"):
        SamplingParams(structured_output={"regex": "a"})
    no_tokenizer = ContinuousBatcher(model, num_blocks=16, block_size=8, async_scheduling=_ASYNC["on"])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        no_tokenizer.add_request([5, 6], SamplingParams(structured_output=SPECS["choice"]))
    engine = make_engine(model, tokenizer)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"pip install 'hf_paged\[structured\]'"):
        engine.add_request("x", SamplingParams(structured_output=SPECS["choice"]))
    assert not engine.has_unfinished_requests()


def test_compiling_grammar_holds_only_its_request(model, tokenizer, monkeypatch):
    """A request waits for its grammar outside the scheduler; the others run on, and a compile that fails ends
    only its own request (finish_reason "abort")."""
    release = threading.Event()
    compile_grammar = structured.GrammarCache._compile
    calls = []

    def slow_compile(cache, grammar):
        calls.append(str(grammar))
        if "yes" in str(grammar):
            release.wait(timeout=60)
        if "boom" in str(grammar):
            raise RuntimeError("out of memory while compiling")
        return compile_grammar(cache, grammar)

    monkeypatch.setattr(structured.GrammarCache, "_compile", slow_compile)
    engine = make_engine(model, tokenizer)
    yes_no = StructuredOutput(choice=["yes", "no"])
    held = engine.add_request("?", SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, structured_output=yes_no))
    same = StructuredOutput(choice=("yes", "no"))  # a tuple: the same spec, the same compile
    again = engine.add_request("!", SamplingParams(max_new_tokens=9, temperature=0.5, seed=2, structured_output=same))
    failing = engine.add_request("?", SamplingParams(structured_output=StructuredOutput(choice=["boom"])))
    plain = engine.add_request("go", SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    outs = {}
    while plain not in outs or failing not in outs:
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert held not in outs and again not in outs  # still waiting for their grammar
    assert outs[failing].outputs[0].finish_reason == "abort" and outs[failing].outputs[0].token_ids == []
    execute = engine.runner.execute

    def failing_execute(*args, **kwargs):
        engine.runner.execute = execute
        raise RuntimeError("injected")

    engine.runner.execute = failing_execute
    with pytest.raises(RuntimeError, match="injected"):  # recovery leaves the held requests waiting, unblocked
        engine.step()
    release.set()
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[held].outputs[0].text in ("yes", "no") and outs[again].outputs[0].text in ("yes", "no")
    assert sum("yes" in c for c in calls) == 1  # one compile for the two equal specs
    assert_engine_drained(engine)


def test_async_engine_serves_structured_requests(model, tokenizer):
    """Through AsyncEngine (the server's engine): outputs parse, and an invalid spec fails only its own call."""
    from hf_paged import AsyncEngine

    async def main():
        async with AsyncEngine(lambda: make_engine(model, tokenizer)) as engine:
            good = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, structured_output=SPECS["regex-date"])
            bad = SamplingParams(structured_output=StructuredOutput(regex="[0-"))
            results = await asyncio.gather(engine.generate("a", good), engine.generate("b", bad),
                                           return_exceptions=True)  # fmt: skip
            check(SPECS["regex-date"], results[0].outputs[0].text)
            assert isinstance(results[1], ValueError) and "`structured_output.regex` is invalid" in str(results[1])
            with pytest.raises(ValueError, match=r"`structured_output.regex` is invalid"):
                engine.stream("b", bad)  # at the call, in the caller's context: the server answers 400 from it

    asyncio.run(main())


def test_half_precision_logits_are_masked(tokenizer):
    """A bf16 model: its logits are inference tensors that the mask changes in place (on the CPU, through an fp32
    copy)."""
    model = tiny_model("llama", device=DEVICE, vocab_size=VOCAB, eos_token_id=EOS).to(torch.bfloat16)
    engine = make_engine(model, tokenizer)
    spec = SPECS["regex-date"]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0, structured_output=spec)
    free = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1)
    outs = engine.generate(["a", "b", "c"], [params, free, params], use_tqdm=False)  # masked rows among free ones
    for out in (outs[0], outs[2]):
        check(spec, out.outputs[0].text)
    assert_engine_drained(engine)


def test_length_bounded_json_strings_refuse_control_characters(tokenizer):
    """JSON forbids raw U+0000-U+001F inside strings: a length-bounded string (maxLength) refuses them as an
    unbounded one does, so that json.loads and pydantic accept every output."""
    xgr = structured.import_xgrammar()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    for schema in ({"type": "string", "maxLength": 8}, {"type": "string", "minLength": 1}, {"type": "string"}):
        grammar = compiler.compile_grammar(structured.parse_grammar(StructuredOutput(json=schema)))
        for text, ok in (('"ab c"', True), ('"ab\x0bc"', False), ('"a\tb"', False), ('"a\x00"', False)):
            assert xgr.GrammarMatcher(grammar).accept_string(text) is ok, (schema, text)


def test_json_strings_refuse_encoded_surrogates(tokenizer):
    """UTF-8-encoded surrogates (ED A0 80 is U+D800, which UTF-8 excludes) decode to three U+FFFD: a string that takes
    them breaks its maxLength, and no valid JSON text holds them. Every JSON string refuses them, in a schema and in
    any-JSON (json_object); other characters, several bytes long too, still pass."""
    xgr = structured.import_xgrammar()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    specs = [StructuredOutput(json=schema) for schema in ({"type": "string", "maxLength": 8}, {"type": "string"})]
    specs.append(StructuredOutput(json_object=True))
    for spec in specs:
        grammar = compiler.compile_grammar(structured.parse_grammar(spec))
        wrap = (lambda s: b'{"k": ' + s + b"}") if spec.json_object else (lambda s: s)
        for text, ok in ((b'"a\xc3\xa9"', True), (b'"\xf0\x9f\x98\x80"', True), (b'"a\xed\xa0\x80"', False),
                         (b'"\xed\xbf\xbf"', False)):  # fmt: skip
            assert xgr.GrammarMatcher(grammar).accept_string(wrap(text)) is ok, (spec, text)


def test_grammars_know_only_the_tokenizers_ids_and_the_rest_is_masked(tokenizer):
    """Logits wider than the tokenizer: the grammars cover its ids (and the stop ids), the columns past them are
    masked in the constrained rows alone."""
    assert structured.grammar_vocab_size(tokenizer, VOCAB, [EOS]) == len(tokenizer.get_vocab()) < VOCAB
    assert structured.grammar_vocab_size(tokenizer, VOCAB, [EOS, 120]) == 121  # a stop id past the tokenizer's
    assert structured.grammar_vocab_size(tokenizer, 50, [EOS]) == 50  # never past the logits
    logits = torch.randn(3, 70)
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)  # [rows, ceil(40 / 32)]: every grammar id allowed
    expected = logits.clone()
    expected[[0, 2], 40:] = float("-inf")
    apply_bitmask(logits, bitmask, 40, [0, 2])
    torch.testing.assert_close(logits, expected)


def test_constrained_steps_run_deferred_and_equal_the_synchronous_engine(model, tokenizer, scheduling_mode):
    """With async scheduling a constrained step is deferred like a plain one (its masks read the step before it back
    once its forward is queued); tokens equal the synchronous engine's, sequences ending mid-flight included."""
    specs = [SPECS["json-required-enum"], SPECS["regex-date"], SPECS["grammar"], None]
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=t, seed=i, structured_output=spec)
              for i, (spec, t) in enumerate((s, t) for s in specs for t in (0.0, 1.0))]  # fmt: skip
    prompts = [f"Record {i}: " for i in range(len(params))]
    expected = make_engine(model, tokenizer, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    engine = make_engine(model, tokenizer, async_scheduling=True)
    launch, deferred = engine._launch, []

    def spy(sched, logits, *args):
        launched = launch(sched, logits, *args)
        if any(r.grammar is not None for r in launched.requests):
            deferred.append(launched.deferred)
        # a sequence the read-back of the step before ended takes no placeholder for this step's token
        assert all(seq.num_inflight == 0 for seq in launched.rows if seq.finish_reason is not None)
        return launched

    engine._launch = spy
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [c.token_ids for o in outs for c in o.outputs] == [c.token_ids for o in expected for c in o.outputs]
    assert deferred and all(deferred), deferred  # every step with a constrained row (no prompt forks here)
    assert_engine_drained(engine)
