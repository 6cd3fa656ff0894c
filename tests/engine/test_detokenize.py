"""Incremental detokenisation (hf_paged.engine.outputs): streamed text equals the final text equals a full decode.

What can go wrong: a character split over tokens streamed as U+FFFD and never repaired; the first characters of a
stop string sent before the match removes them; a forked sample sharing its parent's decoder state; text that
drifts from ``tokenizer.decode`` (a dropped or doubled space at a window edge, a byte left behind at the end).
Two tokenizer kinds: SmolLM2's byte-level BPE, and a SentencePiece-style BPE with byte fallback built in memory;
each through both routes (``DecodeStream`` and the prefix/read offsets over ``tokenizer.decode``).
"""

import random

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, char_tokenizer, metaspace_tokenizer, tiny_model
from transformers import AutoTokenizer

from hf_paged import ContinuousBatcher, SamplingParams
from hf_paged.engine.outputs import Detokenizer, OffsetStream, RustStream, StreamCursor
from hf_paged.engine.request import Request

TEXTS = ["你好，世界！今天天气很好。", "Emoji: 😀🎉👍🏽🇫🇷 done", "naïve café — ünïcödé ✓ 北京 🚀"]
MIXED = "你好，世界! 😀🎉 naïve Hello"
# Tiny models with SmolLM2's tokenizer emit only its first ids (fast on the CPU): bytes, common merges, ASCII words.
_SMALL_VOCAB = 4096


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(params=["smollm2", "metaspace"])
def tokenizer(request):
    return request.getfixturevalue("smollm2") if request.param == "smollm2" else metaspace_tokenizer()


@pytest.fixture(params=["decode-stream", "offsets"])
def route(request):
    return request.param


def _detokenizer(tokenizer, route: str) -> Detokenizer:
    det = Detokenizer(tokenizer)
    assert det.backend is not None  # both tokenizers are fast ones: DecodeStream unless told otherwise
    if route == "offsets":
        det.backend = None
    return det


def _run(det, token_ids, params, request=None):
    """Feed ``token_ids`` one per step, as the engine does (the last one ends the sequence by length);
    returns (the sequence, its stream deltas)."""
    request = request or Request("r", [1], params, None)
    seq = request.seqs[0]
    cursor = StreamCursor()
    deltas = []
    for i, token_id in enumerate(token_ids):
        seq.token_ids.append(token_id)
        if i == len(token_ids) - 1:
            seq.finish_reason = "length"
        stop = det.update(request, seq)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        delta = cursor.next_delta(request, seq)
        if delta is not None:
            deltas.append(delta)
        if seq.is_finished:
            break
    return seq, deltas


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_routes_are_what_they_claim(tokenizer):
    det = Detokenizer(tokenizer)
    request = Request("r", [1], SamplingParams(), None)
    seq = request.seqs[0]
    seq.token_ids.append(_ids(tokenizer, "Hello")[0])
    det.update(request, seq)
    assert isinstance(seq.detok_state.stream, RustStream)

    class Wrapper:  # not a transformers fast tokenizer: its decode may do anything, so the offsets route
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert Detokenizer(Wrapper()).backend is None


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_stream_whole(tokenizer, route, text):
    token_ids = _ids(tokenizer, text)
    assert len(token_ids) > len(text) // 2  # some characters span several tokens
    seq, deltas = _run(_detokenizer(tokenizer, route), token_ids, SamplingParams(max_new_tokens=64))
    assert seq.text == tokenizer.decode(token_ids) == text
    assert "".join(d.text for d in deltas) == text
    assert not any("\ufffd" in d.text for d in deltas)  # never a partial character, repaired later or not
    assert [t for d in deltas for t in d.token_ids] == token_ids  # tokens are never held back
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


@pytest.mark.parametrize("stop", ["世界", "界!", "😀🎉", "🎉 na", "! 😀", "Hello"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_string_spanning_tokens_is_never_sent(tokenizer, route, stop, include):
    token_ids = _ids(tokenizer, MIXED)
    params = SamplingParams(max_new_tokens=64, stop=[stop, "never appears"], include_stop_str_in_output=include)
    seq, deltas = _run(_detokenizer(tokenizer, route), token_ids, params)
    at = MIXED.index(stop)
    expected = MIXED[: at + len(stop)] if include else MIXED[:at]
    assert (seq.text, seq.finish_reason, seq.stop_reason) == (expected, "stop", stop)
    # What was streamed is never taken back: nothing of the stop string went out before the match removed it.
    assert "".join(d.text for d in deltas) == expected
    # Tokens after the one that completed the match are not fed, so the output ends with that token.
    assert seq.output_token_ids == token_ids[: len(seq.output_token_ids)]
    assert tokenizer.decode(seq.output_token_ids).find(stop) >= 0


def test_hold_back_is_the_longest_stop_string_minus_one(route):
    tok = char_tokenizer()
    text = "abcdefghij"
    params = SamplingParams(max_new_tokens=64, stop=["xyz", "q"])
    request = Request("r", [1], params, None)
    seq = request.seqs[0]
    det, cursor = _detokenizer(tok, route), StreamCursor()
    sent = ""
    for i, token_id in enumerate(_ids(tok, text)):
        seq.token_ids.append(token_id)
        det.update(request, seq)
        delta = cursor.next_delta(request, seq)
        sent += delta.text
        assert sent == text[: max(0, i + 1 - 2)]  # 2 = len("xyz") - 1 characters wait
    seq.finish_reason = "length"
    assert cursor.next_delta(request, seq).text == "ij"  # released when the sequence ends
    assert cursor.next_delta(request, seq) is None


def _random_ids(rng, tokenizer):
    """Random tokens: mostly whole vocabulary entries, with the tokens of multi-byte characters in between, and
    sometimes a lone byte or a cut character; at most 30 tokens."""
    vocab = len(tokenizer)
    ids = []
    while len(ids) < rng.randint(1, 30):
        kind = rng.random()
        if kind < 0.6:
            ids.append(rng.randrange(vocab))
        else:
            char_ids = _ids(tokenizer, rng.choice("世界你好😀🎉éü✓🇫🇷"))
            ids += char_ids[: rng.randint(1, len(char_ids))] if kind > 0.95 else char_ids
    return ids


def _is_monotonic(tokenizer, token_ids, skip_special_tokens):
    """Whether each prefix's full decode is a prefix of the next one's. A byte-fallback decoder can take text
    back (valid bytes become U+FFFD when an invalid byte joins their run): no stream can match such a decode."""
    texts = [tokenizer.decode(token_ids[:i], skip_special_tokens=skip_special_tokens) for i in
             range(len(token_ids) + 1)]  # fmt: skip
    return all(b.startswith(a.rstrip("\ufffd")) for a, b in zip(texts, texts[1:], strict=False))


@pytest.mark.parametrize("text", TEXTS)
def test_a_sequence_cut_inside_a_character_ends_without_u_fffd(tokenizer, route, text):
    """max_tokens ending a sequence between a character's bytes: the final and the streamed text both end at the
    last whole character, never with U+FFFD."""
    token_ids = _ids(tokenizer, text)
    cuts = [n for n in range(1, len(token_ids)) if tokenizer.decode(token_ids[:n]).endswith("\ufffd")]
    assert cuts  # the texts have characters split over tokens
    for n in cuts:
        seq, deltas = _run(_detokenizer(tokenizer, route), token_ids[:n], SamplingParams(max_new_tokens=64))
        assert seq.text == "".join(d.text for d in deltas) and text.startswith(seq.text)
        assert "\ufffd" not in seq.text
        if type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel":
            # byte-level BPE: the full decode is right up to its last whole character (a byte-fallback decoder may
            # also turn whole characters before the cut into U+FFFD, which the stream does not)
            assert seq.text == tokenizer.decode(token_ids[:n]).rstrip("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_a_full_decode_on_random_tokens(tokenizer, route, skip_special_tokens):
    """Property-style (fixed seed): random tokens, split characters, special tokens anywhere, sequences that end
    inside a character. Where the full decode never takes text back, the streamed text equals it."""
    rng = random.Random(0)
    det = _detokenizer(tokenizer, route)
    num_checked = 0
    for _ in range(60):
        token_ids = _random_ids(rng, tokenizer)
        params = SamplingParams(max_new_tokens=64, skip_special_tokens=skip_special_tokens)
        seq, deltas = _run(det, token_ids, params)
        assert "".join(d.text for d in deltas) == seq.text, token_ids  # what was sent is never taken back
        if _is_monotonic(tokenizer, token_ids, skip_special_tokens):
            # a character the sequence never finished is dropped, not ended with U+FFFD
            full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
            assert seq.text == full, token_ids
            num_checked += 1
    assert num_checked >= 40  # the generator mostly makes sequences a stream can match


def test_a_decode_that_takes_text_back_does_not_stop_the_stream(route):
    """A byte-fallback decoder turns a decoded ``\r`` into U+FFFD once an invalid byte follows it: DecodeStream
    raises there; the sequence goes on through the offsets route, and the sent text stands."""
    tok = metaspace_tokenizer()
    token_ids = tok.convert_tokens_to_ids(["m", "<0x0D>", "<0x8E>", "<0x81>"]) + _ids(tok, " Hello 世界")
    assert tok.decode(token_ids[:2]) == "m\r" and tok.decode(token_ids[:3]).startswith("m\ufffd")
    seq, deltas = _run(_detokenizer(tok, route), token_ids, SamplingParams(max_new_tokens=64))
    assert "".join(d.text for d in deltas) == seq.text
    assert seq.text.startswith("m\r") and seq.text.endswith(" Hello 世界")


def _byte_ids(tokenizer, text):
    """One token per UTF-8 byte of ``text``: SmolLM2's byte-level alphabet (GPT-2's printable stand-ins for the
    bytes), or the byte-fallback tokens ``<0xNN>``."""
    if tokenizer.convert_tokens_to_ids("<0x41>") != tokenizer.unk_token_id:
        return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in = {b: chr(b) for b in printable}
    stand_in.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in stand_in)})
    return tokenizer.convert_tokens_to_ids([stand_in[b] for b in text.encode()])


def test_forks_keep_independent_streams(tokenizer, route):
    """A sequence forks in the middle of a character (界 and 纪 share their first byte, E7): each fork completes
    it its own way."""
    det = _detokenizer(tokenizer, route)
    request = Request("r", [1], SamplingParams(max_new_tokens=64), None)
    parent = request.seqs[0]
    first, second = _byte_ids(tokenizer, "Hi 世界 😀"), _byte_ids(tokenizer, "Hi 世纪 🎉!")
    shared = _ids(tokenizer, "Hi 世") + first[6:7]  # ... E7 | 95 8C (界) or BA AA (纪)
    assert tokenizer.decode(shared).endswith("\ufffd")
    for token_id in shared:
        parent.token_ids.append(token_id)
        det.update(request, parent)
    child = parent.fork()
    request.seqs = [parent, child]
    for seq, tail in zip((parent, child), (first[7:], second[7:]), strict=True):
        for token_id in tail:
            seq.token_ids.append(token_id)
            det.update(request, seq)
    for seq, text in zip((parent, child), ("Hi 世界 😀", "Hi 世纪 🎉!"), strict=True):
        seq.finish_reason = "length"
        det.update(request, seq)
        assert seq.text == tokenizer.decode(seq.output_token_ids) == text


def test_a_failed_update_is_caught_up_from_the_checked_tokens(route):
    """An exception inside the decoder leaves its state ahead of ``num_detokenized``: the next update rebuilds it."""
    tok = metaspace_tokenizer()
    det = _detokenizer(tok, route)
    request = Request("r", [1], SamplingParams(max_new_tokens=64), None)
    seq = request.seqs[0]
    token_ids = _ids(tok, MIXED)
    for token_id in token_ids[:5]:
        seq.token_ids.append(token_id)
        det.update(request, seq)
    seq.token_ids.append(token_ids[5])
    seq.detok_state.step(token_ids[5])  # read by the decoder, then the update "failed" before recording it
    for token_id in token_ids[6:]:
        seq.token_ids.append(token_id)
        det.update(request, seq)
    assert seq.text == MIXED


def test_offsets_route_decodes_a_window_not_the_whole_output():
    """O(1) work per token: the offsets route decodes a few tokens of context, whatever the output's length."""
    tok = char_tokenizer()
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    stream = OffsetStream(lambda ids: counting.decode(ids))
    text = "".join(stream.step(t) or "" for t in _ids(tok, "abcdefgh" * 250))
    assert text == "abcdefgh" * 250
    assert max(decoded) <= 2


def _engine(tokenizer, async_scheduling, vocab_size):
    torch.manual_seed(0)
    model = tiny_model("llama", device=DEVICE, vocab_size=vocab_size)
    return ContinuousBatcher(model, tokenizer, num_blocks=64, block_size=8, async_scheduling=async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_stream_equals_generate_with_a_stop_string_across_tokens(smollm2, async_scheduling):
    """SmolLM2's tokenizer on a tiny random model: random bytes, split characters and all."""
    engine = _engine(smollm2, async_scheduling, vocab_size=_SMALL_VOCAB)
    prompt = list(range(200, 216))  # any ids of the small vocabulary: the model is random
    free = engine.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert free.text == smollm2.decode(free.token_ids, skip_special_tokens=True)
    # A two-character stop string across the boundary between two tokens' text, well inside the output.
    det, request = Detokenizer(smollm2), Request("x", [1], SamplingParams(max_new_tokens=64), None)
    seq = request.seqs[0]
    boundaries = []
    for token_id in free.token_ids:
        seq.token_ids.append(token_id)
        det.update(request, seq)
        boundaries.append(len(seq.text))
    cut = next(b for b in boundaries if 4 <= b < len(free.text) - 1 and free.text[b - 1 : b + 1].strip())
    stop = free.text[cut - 1 : cut + 1]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    deltas = list(engine.stream(prompt, params))
    assert out.text == free.text[: free.text.index(stop)] and out.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert deltas[-1].stop_reason == stop
    assert_engine_drained(engine)


def test_engine_forks_detokenize_independently(smollm2):
    engine = _engine(smollm2, False, vocab_size=_SMALL_VOCAB)
    params = SamplingParams(n=3, max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    out = engine.generate([[40, 63, 73]], params, use_tqdm=False)[0]
    assert len({c.text for c in out.outputs}) == 3
    for c in out.outputs:
        assert c.text == smollm2.decode(c.token_ids, skip_special_tokens=True)
    assert_engine_drained(engine)


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="the CPU's stamp: a CPU step's tokens exist when it is launched; on CUDA they are stamped when the step's "
    "copy to the host completes. Runs on the CPU (CI)",
)
def test_async_scheduling_stamps_the_first_token_when_it_was_sampled():
    """A deferred step's tokens are applied after the next forward; the first-token time is when they were
    sampled (on the CPU: at once), not when they were applied."""
    engine = _engine(None, True, vocab_size=96)
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's forward samples the first token; its step is deferred
    sampled_by = __import__("time").monotonic()
    engine.step()  # the next forward runs, then the first token is applied
    metrics = engine.get_output(rid).metrics
    assert metrics.first_token_time is not None and metrics.first_token_time <= sampled_by
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_drained(engine)
