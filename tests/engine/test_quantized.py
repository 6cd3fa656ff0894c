"""Quantized weights in the engine and through load_model / the CLI: greedy equal to generate per prompt, quantized
projections left unfused, pre-quantized folders, refusals by name (hf_paged.engine.quantization)."""

import logging
from importlib.metadata import version

import pytest
import torch
from helpers import assert_engine_drained, assert_greedy_equal_up_to_a_near_tie
from models import DEVICE, cache_kwarg, char_tokenizer, tiny_model
from packaging.version import Version
from transformers import BitsAndBytesConfig, DynamicCache

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams, load_model
from hf_paged.engine.compile import compile_layers
from hf_paged.engine.fuse import FusedPart
from hf_paged.engine.quantization import (
    QUANTIZATIONS,
    eager_reason,
    graph_reason,
    quantization_method,
    torchao_config,
    traceable_config,
)
from hf_paged.frontends.cli import main
from hf_paged.frontends.cli_engine import QUANTIZATIONS as CLI_QUANTIZATIONS

quantization = pytest.importorskip(
    "torchao.quantization", reason="needs torchao (the test and quantization extras; CI installs it)"
)

CACHE = cache_kwarg()
CPU_QUANTIZATIONS = ["int8", "int8-dynamic", "int4", "float8"]  # float8-dynamic needs CUDA >= sm89
GREEDY = dict(temperature=0.0, ignore_eos=True)
# 0.18 saves Int8Tensor weights in safetensors; 0.17's int8 weights are AffineQuantizedTensors, which it cannot save.
TORCHAO_SAVES_INT8 = Version(version("torchao")).release >= (0, 18)

# On CUDA a quantized GEMM rounds differently for different row counts (the engine's flat batch, generate's one row;
# int4's tinygemm runs in bfloat16), so a greedy choice between near-tied tokens can go either way. Tolerances in
# nats by the activations' dtype, from this tiny model's log-probabilities measured on the CPU: bfloat16 moves them
# up to 0.0043 from float32's (0.006 with int8 weights), so two bfloat16 roundings of one step differ by up to ~0.01
# and 0.02 leaves 2x; float32 moves them 2e-7 from float64's, far below 1e-4. Wider would wave divergences through
# unexamined: the model's two top tokens lie within 0.02 nats of each other at a quarter of its positions.
NEAR_TIE_NATS = {torch.float32: 1e-4, torch.bfloat16: 0.02}


def _not_lm_head(module, fqn: str) -> bool:  # transformers' TorchAoConfig default: decoder Linears only
    return isinstance(module, torch.nn.Linear) and fqn != "lm_head"


def quantized(model: torch.nn.Module, name: str, filter_fn=_not_lm_head) -> torch.nn.Module:
    if name == "int4" and model.device.type == "cuda":
        model.to(torch.bfloat16)  # torchao's CUDA int4 kernel (tinygemm) takes bfloat16 weights only
    if name != "none":
        precision = torch.get_float32_matmul_precision()
        quantization.quantize_(model, torchao_config(name, model.device, model.dtype), filter_fn=filter_fn)
        # torchao < 0.18's quantize_ also calls torch.set_float32_matmul_precision("high") for the whole process:
        # TF32 on CUDA (~1e-3 relative error) for this test's float32 reference and engine (conftest.py puts it
        # back after each test for the tests that follow).
        torch.set_float32_matmul_precision(precision)
    return model


def _tiny(name: str, attn: str = "paged") -> torch.nn.Module:
    # Seed 1: the unquantized model has no near-tie on these prompts that the engine's flat batch and generate's
    # kernels resolve differently (the "none" case checks it), so a mismatch is the quantization's.
    return quantized(tiny_model("llama", attn=attn, seed=1, device=DEVICE), name)


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 17, 33, 8, 23)]


NEW_TOKENS = [7, 20, 3, 24, 12]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["none", *CPU_QUANTIZATIONS])
def test_greedy_with_preemption_equals_generate_and_leaves_quantized_projections_unfused(name, async_scheduling):
    """A pool small enough to preempt. Weight-only quantizations preempt by recompute; activation quantization by
    swap: a recomputed prompt's K/V come from a prefill GEMM where generate's came from decode GEMMs, and rounding
    activations to int8 turns their few-ulp difference into whole quantization steps (a near-tie token can flip),
    while swapped blocks come back bit for bit. On CUDA a quantized model's tokens may also part at a near tie
    (``NEAR_TIE_NATS``); the CPU and the unquantized model stay exact."""
    reference = _tiny(name, attn="sdpa")
    expected = [
        reference.generate(input_ids=torch.tensor([p], device=DEVICE), max_new_tokens=m, min_new_tokens=m,
                           do_sample=False, **{CACHE: DynamicCache(config=reference.config)})[0, len(p):].tolist()
        for p, m in zip(_prompts(), NEW_TOKENS, strict=True)
    ]  # fmt: skip
    mode = "swap" if name == "int8-dynamic" else "recompute"
    model = _tiny(name)
    engine = ContinuousBatcher(model, block_size=8, num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32,
                               preemption_mode=mode, swap_space_gb=0.01, fuse_projections=True,
                               async_scheduling=async_scheduling)  # fmt: skip
    if name != "none":  # every q/k/v and gate/up weight is quantized: nothing fused
        assert engine.runner.fused_groups == []
        assert not any(isinstance(m, FusedPart) for m in model.modules())
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS]
    got = [o.outputs[0].token_ids for o in engine.generate(_prompts(), params, use_tqdm=False)]
    if name == "none" or DEVICE != "cuda":
        assert got == expected
    else:
        for prompt, tokens, want in zip(_prompts(), got, expected, strict=True):
            assert_greedy_equal_up_to_a_near_tie(reference, prompt, tokens, want, NEAR_TIE_NATS[reference.dtype])
    assert engine.metrics().num_preemptions > 0
    assert_engine_drained(engine)


def test_near_tie_check_accepts_a_flip_within_its_tolerance_only():
    """The CUDA check above, on a flip made by hand: the runner-up token in place of the reference's first token
    passes at a tolerance of their gap and fails just below it; nothing after the flip is compared."""
    model = _tiny("int8", attn="sdpa")
    prompt = _prompts()[1]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float(), dim=-1)
    (first, second), (best, runner_up) = logprobs.topk(2).values.tolist(), logprobs.topk(2).indices.tolist()
    expected, flipped = [best, 11, 12, 13], [runner_up, 7, 7, 7]
    assert_greedy_equal_up_to_a_near_tie(model, prompt, flipped, expected, tolerance=first - second)
    with pytest.raises(AssertionError, match="first differ at output position 0"):
        assert_greedy_equal_up_to_a_near_tie(model, prompt, flipped, expected, tolerance=(first - second) * 0.99)
    assert_greedy_equal_up_to_a_near_tie(model, prompt, expected, expected, tolerance=0.0)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.skipif(
            name == "int8-dynamic" and DEVICE == "cuda",
            reason="on CUDA the engine runs int8-dynamic without graphs (its eager GEMM syncs with the host; "
            "test_int8_dynamic_activations_run_without_cuda_graphs_on_cuda checks it); runs on the CPU, where the "
            "buckets run eagerly",
        ))
        for name in CPU_QUANTIZATIONS
    ],
)  # fmt: skip
def test_graph_buckets_equal_eager_steps(name):
    """Steps through the graph buckets' padded static inputs (padding tokens and sequences, padded logits rows; on
    the CPU ``emulate_graphs`` runs them eagerly, on CUDA they replay captured graphs) give the eager engine's
    tokens: the quantized GEMMs see padded rows they must not mix into the real ones."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 37, 20, 1, 61)]
    params = [SamplingParams(max_new_tokens=m, **GREEDY) for m in (9, 14, 6, 20, 12)]
    outputs = {}
    for graphs in (False, True):
        engine, buckets = _engine_counting_buckets(_tiny(name), graphs)
        outputs[graphs] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert ({"decode", "mixed"} <= set(buckets)) if graphs else not buckets, buckets
        assert_engine_drained(engine)
    assert outputs[True] == outputs[False]


def test_int8_dynamic_activations_run_without_cuda_graphs_on_cuda(caplog):
    """torchao's int8 x int8 GEMM syncs with the host when eager (``graph_reason``): for CUDA, graphs left to their
    default are turned off with a warning saying why, asked for explicitly they are refused, and compilation stays
    as asked. Weight-only int8 keeps its graphs. The configs are resolved for CUDA on any device (the weights are the
    same torchao tensors on the CPU); on CUDA the engine is built too."""
    model, cuda = _tiny("int8-dynamic"), torch.device("cuda")
    reason = graph_reason(model, cuda)
    assert reason is not None and "int8 dynamic activation quantization" in reason and "model.layers.0." in reason
    assert graph_reason(model, "cpu") is None
    assert graph_reason(_tiny("int8"), cuda) is None
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine.quantization"):
        config = traceable_config(EngineConfig(compile_model="layers"), model, cuda)
    assert (config.use_cuda_graphs, config.compile_model) == (False, "layers")
    assert "int8 dynamic activation quantization" in caplog.text and "without CUDA graphs" in caplog.text
    refusal = r"int8 dynamic activation quantization .* cannot capture: pass use_cuda_graphs=False, or leave it unset"
    with pytest.raises(ValueError, match=refusal):
        traceable_config(EngineConfig(use_cuda_graphs=True), model, cuda)
    if DEVICE != "cuda":
        return
    with pytest.raises(ValueError, match=refusal):
        ContinuousBatcher(model, block_size=8, num_blocks=32, use_cuda_graphs=True)
    engine = ContinuousBatcher(model, block_size=8, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=32)
    assert not engine.runner.use_cuda_graphs
    outs = engine.generate(_prompts(), [SamplingParams(max_new_tokens=m, **GREEDY) for m in NEW_TOKENS],
                           use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outs] == NEW_TOKENS
    assert_engine_drained(engine)


def _engine_counting_buckets(model, graphs: bool) -> tuple[ContinuousBatcher, list[str]]:
    """An engine whose steps run through the graph buckets when ``graphs``, and the list of the buckets' kinds
    ("decode", "mixed") its steps ran in."""
    engine = ContinuousBatcher(model, block_size=8, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=32,
                               use_cuda_graphs=graphs and DEVICE == "cuda")  # fmt: skip
    engine.runner.emulate_graphs = graphs and DEVICE != "cuda"
    buckets, run_static = [], engine.runner._run_static

    def counting(bucket, *args):
        buckets.append(bucket[0])
        return run_static(bucket, *args)

    engine.runner._run_static = counting
    return engine, buckets


def test_fusion_skips_only_the_quantized_groups():
    """Attention quantized, MLP plain: gate/up fuse, q/k/v keep their own quantized GEMMs, outputs unchanged."""
    model = tiny_model("llama", attn="paged", device=DEVICE)
    quantized(model, "int8", filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "self_attn" in fqn)
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids, attention_mask=torch.ones_like(ids)).logits
    engine = ContinuousBatcher(model, num_blocks=16, block_size=8, fuse_projections=True)
    layer = model.model.layers[0]
    assert len(engine.runner.fused_groups) == len(model.model.layers)  # one gate/up group per layer
    assert isinstance(layer.mlp.gate_proj, FusedPart) and not isinstance(layer.self_attn.q_proj, FusedPart)
    assert type(layer.self_attn.q_proj.weight) is not torch.nn.Parameter  # a torchao tensor
    with torch.no_grad():
        after = model(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_quantization_method_reads_the_config_or_the_weights():
    assert quantization_method(tiny_model("llama")) is None
    assert quantization_method(quantized(tiny_model("llama"), "float8")) == "torchao"  # quantize_, no config
    model = tiny_model("llama")
    model.config.quantization_config = BitsAndBytesConfig(load_in_4bit=True)
    assert quantization_method(model) == "bitsandbytes"


def test_llm_int8_runs_eagerly_with_a_reason(caplog):
    """bitsandbytes 8-bit with an outlier threshold cannot be traced: compile_layers leaves the layers eager and logs
    why; 4-bit and threshold 0 compile."""
    model = tiny_model("llama")
    model.config.quantization_config = BitsAndBytesConfig(load_in_8bit=True)  # llm_int8_threshold=6.0
    with caplog.at_level(logging.WARNING, logger="hf_paged.engine.compile"):
        assert compile_layers(model) == []
    assert "llm_int8_threshold=6.0" in caplog.text and "run eagerly" in caplog.text
    assert not any(getattr(m, "_hf_paged_compiled", False) for m in model.modules())
    model.config.quantization_config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    assert eager_reason(model) is None
    model.config.quantization_config = BitsAndBytesConfig(load_in_4bit=True)
    assert eager_reason(model) is None


def test_torchao_config_refuses_by_name():
    with pytest.raises(ValueError, match=r"`quantization` must be one of \[.*'int8'.*\], got 'int3'"):
        torchao_config("int3", "cpu", torch.float32)
    with pytest.raises(ValueError, match="float8-dynamic needs a CUDA GPU of compute capability >= 8.9.*'cpu'"):
        torchao_config("float8-dynamic", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="int4 on CUDA needs bfloat16 weights.*torch.float32"):
        torchao_config("int4", "cuda", torch.float32)
    assert torchao_config("none", "cpu", torch.float32) is None
    assert type(torchao_config("int4", "cpu", torch.float32)).__name__ == "IntxWeightOnlyConfig"
    assert CLI_QUANTIZATIONS == tuple(QUANTIZATIONS)  # the CLI's copy of the names, kept without importing torch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny llama and the character tokenizer saved as a model folder; intermediate_size 128: bitsandbytes' CPU
    4-bit GEMM takes input widths in whole blocks of 64 (96 fails with "shape '[64, 1]' is invalid")."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", attn="sdpa", intermediate_size=128).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def test_load_model_quantizes_on_load(tiny_dir):
    model, _ = load_model(tiny_dir, device="cpu", quantization="int8")
    assert quantization_method(model) == "torchao"
    assert type(model.model.layers[0].mlp.down_proj.weight) is not torch.nn.Parameter  # a torchao tensor
    assert type(model.lm_head.weight) is torch.nn.Parameter  # the output embedding stays as it was


@pytest.mark.skipif(not TORCHAO_SAVES_INT8, reason="needs torchao>=0.18's safetensors support for int8 weights "
                    "(the test extra's version); runs in CI")  # fmt: skip
def test_a_saved_quantized_folder_loads_without_the_flag(tiny_dir, tmp_path):
    model, _ = load_model(tiny_dir, device="cpu", quantization="int8")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    reloaded, _ = load_model(str(tmp_path), device="cpu")
    assert type(reloaded.model.layers[0].mlp.down_proj.weight) is type(model.model.layers[0].mlp.down_proj.weight)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)
    with pytest.raises(ValueError, match="stored quantized already.*torchao.*drop quantization='int4'"):
        load_model(str(tmp_path), device="cpu", quantization="int4")


def test_cli_generate_quantizes_and_refuses_by_name(tiny_dir, capsys):
    argv = ["generate", "--model", tiny_dir, "--device", "cpu", "--no-chat", "--max-new-tokens", "4", "--ignore-eos",
            "--json"]  # fmt: skip
    assert main([*argv, "--quantization", "int8", "abc"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    assert main([*argv, "--quantization", "float8-dynamic", "abc"]) == 2
    assert "hf-paged: error: --quantization float8-dynamic needs a CUDA GPU" in capsys.readouterr().err
    assert main([*argv, "--quantization", "int3", "abc"]) == 2
    assert "argument --quantization: invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_folder_runs_in_paged_cache_and_the_engine(tiny_dir, bits):
    """transformers' bitsandbytes integration (0.50 runs on the CPU): Linear8bitLt / Linear4bit modules, loaded from
    a plain folder with a BitsAndBytesConfig; PagedCache and the engine equal DynamicCache's greedy tokens."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install bitsandbytes; not in the extras CI "
                        "installs): runs wherever it is installed, the CPU included")  # fmt: skip
    from transformers import AutoModelForCausalLM

    from hf_paged import PagedCache

    config = BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(load_in_4bit=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=config, attn_implementation="paged",
                                                 device_map=DEVICE)  # fmt: skip
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == ("Linear8bitLt" if bits == 8 else "Linear4bit")
    assert (eager_reason(model) is not None) == (bits == 8)  # LLM.int8's outlier threshold: eager
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]], device=DEVICE)
    kwargs = dict(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        expected = model.generate(**kwargs, **{CACHE: DynamicCache(config=model.config)})
        out = model.generate(**kwargs, **{CACHE: PagedCache(model, num_blocks=16, block_size=8)})
    assert torch.equal(out, expected)
    engine = ContinuousBatcher(model, num_blocks=16, block_size=8, fuse_projections=True)
    assert engine.runner.fused_groups == []  # bitsandbytes' Linear subclasses keep their own forward
    out = engine.generate([ids[0].tolist()], SamplingParams(max_new_tokens=12, **GREEDY), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()
    assert_engine_drained(engine)
