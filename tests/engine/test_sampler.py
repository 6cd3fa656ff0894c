"""SamplingParams validation and the batched Sampler: each pipeline stage against a hand-computed or HF reference.

Distribution checks sample one small vocabulary many times in a single call (one row per draw) with a
fixed seed, and compare frequencies within ~5 standard deviations.
"""

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hf_paged.engine.params import SamplingParams
from hf_paged.engine.sampler import Sampler, SamplerOutput, apply_penalties, plan_rows

sampler = Sampler()


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab_size]
    params: list[SamplingParams],
    output_token_ids: list[list[int]] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> SamplerOutput:
    num_seqs = logits.shape[0]
    return sampler(
        logits,
        params,
        output_token_ids or [[] for _ in range(num_seqs)],
        prompt_token_ids or [[] for _ in range(num_seqs)],
        generators or [None] * num_seqs,
        eos_token_ids,
    )


def draw(probs: list[float], params: SamplingParams, num_draws: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Token frequencies [vocab_size] of num_draws samples from logits = log(probs)."""
    torch.manual_seed(seed)
    logits = torch.tensor(probs).log().expand(num_draws, -1)
    tokens = sample(logits, [params] * num_draws).token_ids
    return torch.bincount(tokens, minlength=len(probs)).float() / num_draws


def assert_frequencies(freq: torch.Tensor, expected: list[float], num_draws: int = 20_000) -> None:
    expected_t = torch.tensor(expected)
    tolerance = 5 * (expected_t * (1 - expected_t) / num_draws).sqrt() + 1e-9
    assert ((freq - expected_t).abs() <= tolerance).all(), (freq, expected_t)


# ---- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n": 0}, ValueError, r"`n` must be >= 1, got 0"),
        ({"n": 1.0}, TypeError, r"`n` must be an int, got 1.0"),
        ({"beam_width": 0}, ValueError, r"`beam_width` must be >= 1 .*got 0"),
        ({"max_new_tokens": 0}, ValueError, r"`max_new_tokens` must be >= 1, got 0"),
        ({"max_new_tokens": True}, TypeError, r"`max_new_tokens` must be an int, got True"),
        ({"min_tokens": -1}, ValueError, r"`min_tokens` must be in \[0, max_new_tokens=16\], got -1"),
        ({"min_tokens": 17}, ValueError, r"`min_tokens` must be in \[0, max_new_tokens=16\], got 17"),
        ({"temperature": -0.5}, ValueError, r"`temperature` must be 0.0 \(greedy\) or in \[0.01, inf\), got -0.5"),
        ({"temperature": 1e-3}, ValueError, r"`temperature` must be .*got 0.001"),
        ({"temperature": math.inf}, ValueError, r"`temperature` must be .*got inf"),
        ({"temperature": "hot"}, TypeError, r"`temperature` must be a float, got 'hot'"),
        ({"top_k": -1}, ValueError, r"`top_k` must be 0 \(off\) or >= 1, got -1"),
        ({"top_p": 1.5}, ValueError, r"`top_p` must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, ValueError, r"`top_p` must be in \(0, 1\], got 0.0"),
        ({"top_p": math.nan}, ValueError, r"`top_p` must be in \(0, 1\], got nan"),
        ({"min_p": -0.1}, ValueError, r"`min_p` must be in \[0, 1\], got -0.1"),
        ({"min_p": 1.1}, ValueError, r"`min_p` must be in \[0, 1\], got 1.1"),
        ({"seed": -1}, ValueError, r"`seed` must be None or in \[0, 2\*\*64\), got -1"),
        ({"seed": "7"}, TypeError, r"`seed` must be an int, got '7'"),
        ({"repetition_penalty": 0.0}, ValueError, r"`repetition_penalty` must be in \(0, inf\) .*got 0.0"),
        ({"presence_penalty": 2.5}, ValueError, r"`presence_penalty` must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, ValueError, r"`frequency_penalty` must be in \[-2, 2\], got -3.0"),
        ({"stop_token_ids": 2}, TypeError, r"`stop_token_ids` must be a list or tuple of ints, got 2"),
        ({"stop_token_ids": [1, -2]}, ValueError, r"`stop_token_ids` must be token ids >= 0, got -2"),
        ({"stop_token_ids": ["a"]}, TypeError, r"`stop_token_ids` must be an int, got 'a'"),
        ({"stop": 3}, TypeError, r"`stop` must be a str or a list of str, got 3"),
        ({"stop": ["a", 1]}, TypeError, r"`stop` must be a str or a list of str, got 1"),
        ({"stop": [""]}, ValueError, r"`stop` strings must be non-empty"),
        ({"ignore_eos": 1}, TypeError, r"`ignore_eos` must be a bool, got 1"),
        ({"logprobs": 21}, ValueError, r"`logprobs` must be None or in \[0, 20\], got 21"),
        ({"logprobs": -1}, ValueError, r"`logprobs` must be None or in \[0, 20\], got -1"),
        ({"length_penalty": math.inf}, ValueError, r"`length_penalty` must be finite, got inf"),
        ({"skip_special_tokens": "no"}, TypeError, r"`skip_special_tokens` must be a bool"),
        ({"include_stop_str_in_output": None}, TypeError, r"`include_stop_str_in_output` must be a bool"),
        ({"beam_width": 2, "n": 3}, ValueError, r"`n` must be in \[1, beam_width=2\] with beam search, got 3"),
        ({"beam_width": 4, "top_k": 5}, ValueError, r"`top_k` must be 0 \(its default\) with beam search"),
        ({"beam_width": 4, "top_p": 0.9}, ValueError, r"`top_p` must be 1.0 \(its default\) .*got 0.9"),
        ({"beam_width": 4, "min_p": 0.1}, ValueError, r"`min_p` must be 0.0 \(its default\)"),
        ({"beam_width": 4, "repetition_penalty": 1.2}, ValueError, r"`repetition_penalty` must be 1.0"),
        ({"beam_width": 4, "presence_penalty": 1.0}, ValueError, r"`presence_penalty` must be 0.0"),
        ({"beam_width": 4, "frequency_penalty": 1.0}, ValueError, r"`frequency_penalty` must be 0.0"),
    ],
)
def test_sampling_params_refuse_bad_values_with_messages(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_params_normalisation_and_is_greedy():
    params = SamplingParams(stop="###", stop_token_ids=[7, 9], temperature=1, n=2)  # beam search refuses `stop`
    assert params.stop == ("###",) and params.stop_token_ids == (7, 9)
    assert isinstance(params.temperature, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert SamplingParams(beam_width=4, temperature=0.5, seed=3).beam_width == 4  # temperature ignored, allowed


# ---- Sampler: greedy, temperature, top-k, top-p, min-p -------------------------------------------


def test_greedy_is_argmax_of_upcast_logits():
    torch.manual_seed(0)
    logits = torch.randn(6, 100).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.7)] * 3
    out = sample(logits, params)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert torch.equal(logits, before)  # the caller's logits are never changed
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None
    # Greedy-only rows read the logits as given (no copy); any stage that changes logits works on an fp32 copy.
    for params in ([SamplingParams(temperature=0.0, logprobs=3)] * 6,
                   [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1)] * 3,
                   [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 6):  # fmt: skip
        gens = [torch.Generator().manual_seed(1) if p.seed is not None else None for p in params]
        out = sample(logits, params, prompt_token_ids=[[5, 7]] * 6, generators=gens)
        assert torch.equal(logits, before)
        if params[0].logprobs:
            raw = torch.log_softmax(logits.float(), dim=-1)
            assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
            torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
            torch.testing.assert_close(out.top_logprobs, raw.topk(3, dim=-1).values)


def test_temperature_distribution():
    probs, temperature = [0.1, 0.2, 0.3, 0.4], 0.7
    expected = torch.tensor(probs) ** (1 / temperature)
    assert_frequencies(draw(probs, SamplingParams(temperature=temperature)), (expected / expected.sum()).tolist())
    assert_frequencies(draw(probs, SamplingParams()), probs)


def test_top_k_support_and_mixed_batch():
    probs = [0.05, 0.3, 0.1, 0.2, 0.02, 0.25, 0.08]  # top 3: ids 1, 5, 3
    num_draws = 20_000
    torch.manual_seed(0)
    logits = torch.tensor(probs).log().expand(num_draws, -1)
    params = [SamplingParams(top_k=3), SamplingParams(top_k=0)] * (num_draws // 2)
    tokens = sample(logits, params).token_ids
    top_k_freq = torch.bincount(tokens[0::2], minlength=7).float() / (num_draws // 2)
    off_freq = torch.bincount(tokens[1::2], minlength=7).float() / (num_draws // 2)
    assert set(tokens[0::2].tolist()) == {1, 3, 5}
    assert_frequencies(top_k_freq, [0, 0.3 / 0.75, 0, 0.2 / 0.75, 0, 0.25 / 0.75, 0], num_draws // 2)
    assert_frequencies(off_freq, probs, num_draws // 2)  # top_k=0 rows are untouched by their companions
    # k at or past the vocabulary keeps every token
    assert set(sample(logits[:2000], [SamplingParams(top_k=7)] * 2000).token_ids.tolist()) == set(range(7))


@pytest.mark.parametrize(
    "top_p, nucleus",
    [(0.45, [1]), (0.7, [1, 3]), (0.8, [1, 3, 0]), (0.95, [1, 3, 0, 2]), (1.0, [1, 3, 0, 2])],
)
def test_top_p_support_is_the_nucleus(top_p, nucleus):
    probs = [0.15, 0.5, 0.1, 0.25]  # sorted: 1 (0.5), 3 (0.25), 0 (0.15), 2 (0.1)
    freq = draw(probs, SamplingParams(top_p=top_p))
    mass = sum(probs[i] for i in nucleus)
    assert_frequencies(freq, [probs[i] / mass if i in nucleus else 0.0 for i in range(4)])


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    probs = [0.5, 0.3, 0.15, 0.05]  # min_p 0.2 -> threshold 0.1 drops id 3
    assert_frequencies(draw(probs, SamplingParams(min_p=0.2)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert_frequencies(draw(probs, SamplingParams(min_p=0.7)), [1.0, 0.0, 0.0, 0.0])


def test_top_k_then_top_p_then_min_p_compose():
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    # top_k 4 -> renormalised [0.4167, 0.3125, 0.2083, 0.0625]; top_p 0.9 drops id 3; min_p 0.6 drops id 2
    freq = draw(probs, SamplingParams(top_k=4, top_p=0.9, min_p=0.6))
    assert_frequencies(freq, [0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0, 0.0])


# ---- penalties and min_tokens ----------------------------------------------------------------------


def test_penalties_match_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]]).repeat(4, 1)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # unchanged
        SamplingParams(presence_penalty=1.0),  # output tokens only: the prompt's token 0 is not penalised
        SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0),  # ids outside the vocab are ignored
    ]
    outputs, prompts = [[1, 1, 2], [1, 1, 2], [3], [9, -1]], [[0], [0], [0], [5, 4]]
    out = apply_penalties(logits.clone(), params, outputs, prompts)
    # row 0: repetition over {0, 1, 2}: [1.0, -2.0, 0.25, -3, 1]; token 1 (count 2): -2 - 0.5 - 0.5;
    # token 2 (count 1): 0.25 - 0.25 - 0.5. Row 3: only prompt token 4 is in the vocab: 1.0 / 3.
    expected = torch.tensor(
        [
            [1.0, -3.0, -0.5, -3.0, 1.0],
            [2.0, -1.0, 0.5, -3.0, 1.0],
            [2.0, -1.0, 0.5, -4.0, 1.0],
            [2.0, -1.0, 0.5, -3.0, 1.0 / 3.0],
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_repetition_penalty_matches_hf():
    torch.manual_seed(0)
    vocab_size, penalty = 50, 1.3
    logits = torch.randn(3, vocab_size) * 3
    input_ids = torch.randint(0, vocab_size, (3, 12))
    prompts, outputs = input_ids[:, :5].tolist(), input_ids[:, 5:].tolist()
    ours = apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=penalty)] * 3, outputs, prompts)
    hf = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)


def test_min_tokens_masks_eos_and_stop_ids():
    eos, stop = 5, 4
    logits = torch.arange(6.0).expand(4, -1)  # argmax would be EOS, then the stop id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),  # min_tokens masks EOS regardless
        SamplingParams(temperature=0.0, stop_token_ids=(stop,)),
    ]
    outputs = [[0, 1], [0, 1, 2], [0], [0]]
    assert sample(logits, params, outputs, eos_token_ids=(eos,)).token_ids.tolist() == [3, 5, 4, 5]
    # sampled rows never draw a masked id
    torch.manual_seed(0)
    sampled = SamplingParams(min_tokens=3, stop_token_ids=(stop,))
    tokens = sample(logits[:1].expand(3000, -1), [sampled] * 3000, [[]] * 3000, eos_token_ids=(eos,)).token_ids
    assert set(tokens.tolist()) == {0, 1, 2, 3}


# ---- seeds, logprobs, errors ------------------------------------------------------------------------


def test_seeded_rows_reproducible_and_independent_of_batch():
    torch.manual_seed(0)
    vocab_size = 64
    row = torch.randn(vocab_size)
    companions = torch.randn(4, vocab_size)
    target = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.01, seed=1)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, frequency_penalty=1.0),
        SamplingParams(seed=99, top_p=0.5, repetition_penalty=1.5),
        SamplingParams(min_p=0.2, min_tokens=4, stop_token_ids=(3,)),
    ]
    tokens = []
    for seed in range(12):
        alone = sample(row[None], [target], generators=[torch.Generator().manual_seed(seed)]).token_ids[0]
        again = sample(row[None], [target], generators=[torch.Generator().manual_seed(seed)]).token_ids[0]
        batch = torch.cat([companions[:2], row[None], companions[2:]])
        generators = [None, None, torch.Generator().manual_seed(seed), torch.Generator().manual_seed(7), None]
        mixed = sample(
            batch,
            others[:2] + [target] + others[2:],
            output_token_ids=[[1, 2], [3, 3, 3], [], [5], [6]],
            prompt_token_ids=[[0], [1], [2], [3], [4]],
            generators=generators,
            eos_token_ids=(0,),
        ).token_ids[2]
        assert alone == again == mixed
        tokens.append(int(alone))
    assert len(set(tokens)) > 1  # the seed matters


def test_logprobs_are_raw_and_top_k_sorted():
    torch.manual_seed(0)
    logits = torch.randn(4, 30).to(torch.float16)
    params = [
        SamplingParams(logprobs=3, temperature=1.3, repetition_penalty=1.4),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=0, top_k=2),
        SamplingParams(logprobs=5, min_p=0.1),
    ]
    out = sample(logits, params, output_token_ids=[[1, 2], [], [], [4]])
    raw = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == out.top_token_ids.shape == (4, 5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_token_ids))
    torch.testing.assert_close(out.top_logprobs, raw.topk(5, dim=-1).values)


def test_row_plan_of_a_subset_of_rows_equals_a_fresh_plan():
    """RowPlan.take (the engine keeps the rows of the sequences that stay) gives the plan of the rows it picks."""
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=5, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.9),
    ]
    generators = [None, torch.Generator().manual_seed(1), None, None, None, None]
    device = torch.device("cpu")
    for rows in ([0, 1, 2, 3, 4, 5], [0, 2], [0, 2, 4], [1, 3, 5], [5, 1], [3], [2], [4], []):
        for idx in (rows, [i for i in rows if i % 2 == 0]):
            for all_rows in (list(range(6)), [0, 2, 4], [1, 5]):  # the plan's own rows: a subset of these too
                if not set(idx) <= set(all_rows):
                    continue
                plan = plan_rows([params[i] for i in all_rows], [generators[i] for i in all_rows], device)
                picked = [all_rows.index(i) for i in idx]
                taken = plan.take(picked, [params[i] for i in idx])
                assert taken == plan_rows([params[i] for i in idx], [generators[i] for i in idx], device)


def test_sampler_refuses_mismatched_inputs_with_messages():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"`params` must have one entry per logits row \(2\), got 1"):
        sample(logits, [SamplingParams()])
    with pytest.raises(ValueError, match=r"`logits` must be 2-D \[num_seqs, vocab_size\], got shape \(8,\)"):
        sampler(logits[0], [SamplingParams()], [[]], [[]], [None])
    with pytest.raises(ValueError, match=r"row 1 uses beam search \(beam_width=2\); beams are ranked by the engine's"):
        sample(logits, [SamplingParams(), SamplingParams(beam_width=2)])
    with pytest.raises(ValueError, match=r"row 0 has seed=3 but no generator"):
        sample(logits, [SamplingParams(seed=3), SamplingParams()])
    sample(logits, [SamplingParams(seed=3, temperature=0.0)] * 2)  # greedy rows need no generator
