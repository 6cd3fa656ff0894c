"""Fused projections (hf_paged.engine.fuse): one GEMM for q/k/v and for gate/up, outputs and weights unchanged."""

import gc

import pytest
import torch
from helpers import assert_engine_drained
from models import DEVICE, tiny_model
from torch import nn

from hf_paged import ContinuousBatcher, EngineConfig, SamplingParams
from hf_paged.engine.fuse import FusedPart, fuse_projections, unfuse_projections


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mistral"])
def test_fused_model_equals_the_original_and_keeps_its_weights(family):
    model = tiny_model(family, attn="eager")
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    num_params = sum(p.numel() for p in model.parameters())
    groups = fuse_projections(model)
    layers = model.model.layers
    assert len(groups) == 2 * len(layers)
    attn, mlp = layers[0].self_attn, layers[0].mlp
    assert all(isinstance(getattr(attn, n), FusedPart) for n in ("q_proj", "k_proj", "v_proj"))
    assert all(isinstance(getattr(mlp, n), FusedPart) for n in ("gate_proj", "up_proj"))
    # The parameters are views of the fused weight: no second copy, same state_dict.
    fused = attn.q_proj._group.weight
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == num_params
    after_state = model.state_dict()
    assert after_state.keys() == state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in state.items())
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)
    assert attn.q_proj._group.input is None and attn.q_proj._group.output is None  # nothing held after a forward
    assert fuse_projections(model) == groups  # fused once: a second call finds the same groups
    # load_state_dict writes through the views into the fused weight; a cast gives the parameters new storage and
    # the parts fall back to their own GEMMs
    model.load_state_dict({k: v * 0.5 if k.endswith("k_proj.weight") else v for k, v in state.items()})
    halved = _logits(model, ids)
    model.load_state_dict(state)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(halved, before)
    torch.testing.assert_close(_logits(model.double(), ids.clone()).float(), before, rtol=1e-4, atol=1e-4)
    model.float()  # back to fp32, new storage: the parts keep running their own GEMMs, on the current weights
    model.load_state_dict({k: v * 0.5 if k.endswith("k_proj.weight") else v for k, v in state.items()})
    torch.testing.assert_close(_logits(model, ids), halved, rtol=1e-5, atol=1e-5)
    model.load_state_dict(state)
    unfuse_projections(groups)
    assert type(layers[0].self_attn.q_proj) is nn.Linear
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)


def test_a_part_called_with_another_input_computes_its_own_projection():
    lin = [nn.Linear(8, n, bias=True) for n in (4, 6, 2)]
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = lin
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    expected = [m(x).detach() for m in lin], lin[1](y).detach()
    fuse_projections(parent)
    with torch.no_grad():
        q = parent.q_proj(x)
        k_other = parent.k_proj(y)  # not the tensor q_proj saw: its own GEMM
        k, v = parent.k_proj(x), parent.v_proj(x)
        v_again = parent.v_proj(x)  # called again after the group's parts were all read: computed again
    torch.testing.assert_close(k_other, expected[1])
    for got, want in zip((q, k, v), expected[0], strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(v_again, expected[0][2])


def test_modules_that_cannot_share_a_gemm_are_left_alone():
    class MyLinear(nn.Linear):
        pass

    def group(**changes):
        parent = nn.Module()
        parent.gate_proj = changes.get("gate", nn.Linear(8, 4, bias=False))
        parent.up_proj = changes.get("up", nn.Linear(8, 4, bias=False))
        return parent

    hooked = nn.Linear(8, 4, bias=False)
    hooked.register_forward_hook(lambda *a: None)
    cases = {
        "subclass": group(up=MyLinear(8, 4, bias=False)),
        "input width": group(up=nn.Linear(6, 4, bias=False)),
        "dtype": group(up=nn.Linear(8, 4, bias=False, dtype=torch.float64)),
        "bias on one": group(up=nn.Linear(8, 4, bias=True)),
        "forward hook": group(up=hooked),
        "one missing": nn.Module(),
    }
    cases["one missing"].gate_proj = nn.Linear(8, 4)
    for name, parent in cases.items():
        assert fuse_projections(parent) == [], name
        assert not isinstance(parent.gate_proj, FusedPart), name
    # Phi-3 already has one qkv_proj and one gate_up_proj: nothing to fuse.
    assert fuse_projections(tiny_model("phi3", attn="sdpa")) == []


def test_fused_layers_trace_into_one_gemm_per_group():
    model = tiny_model("qwen3", attn="sdpa", num_hidden_layers=1)
    fuse_projections(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)])
        return gm.forward

    layer = model.model.layers[0]
    layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (5, 9, 13):  # new shapes: no recompile past the first dynamic one
            model(torch.randint(3, 96, (1, length)))
    assert 1 <= len(graphs) <= 2, len(graphs)
    assert len(graphs[-1]) == 4  # q/k/v fused, o_proj, gate/up fused, down_proj


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_with_fused_projections_equals_without(family):
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 33)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=9, temperature=0.8, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2)]  # fmt: skip
    outputs = {}
    for fuse in (False, True):
        model = tiny_model(family, device=DEVICE)
        engine = ContinuousBatcher(model, config=EngineConfig(num_blocks=24, block_size=8, fuse_projections=fuse))
        assert bool(engine.runner.fused_groups) == fuse
        outs = engine.generate(prompts, params, use_tqdm=False)
        outputs[fuse] = [[c.token_ids for c in o.outputs] for o in outs]
        assert_engine_drained(engine)
    assert outputs[True] == outputs[False]


def test_fuse_projections_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="fuse_projections"):
        EngineConfig(fuse_projections="yes")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the pool is sized by a profiling forward on CUDA only: runs on CUDA with HF_PAGED_TEST_DEVICE=cuda "
    "(benchmarks/run_gpu.sh tests)",
)
def test_the_profiling_forward_fuses_only_when_the_engine_does():
    for fuse in (False, None):
        model = tiny_model("llama", device="cuda")
        engine = ContinuousBatcher(model, config=EngineConfig(fuse_projections=fuse, gpu_memory_utilization=0.2,
                                                              use_cuda_graphs=False, compile_model=False))  # fmt: skip
        assert engine.memory_profile is not None  # the pool was sized by the profiling forward
        fused = any(isinstance(m, FusedPart) for m in model.modules())
        assert fused == (fuse is None) == bool(engine.runner.fused_groups)
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        engine.close()
        # The next engine is sized from the card's free memory: this one's pool must be gone first (a live engine
        # holds 0.2 of the card, and the second profile then finds no room).
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()


def test_a_fused_model_under_generates_fullgraph_compile_equals_dynamic_cache():
    """The compiled PagedCache path (transformers' compile_config, fullgraph=True: a graph break fails) over a fused
    model: the parts' Python state traces without breaks, tokens equal DynamicCache's on the unfused model."""
    from models import cache_kwarg
    from transformers import CompileConfig, DynamicCache

    from hf_paged import PagedCache

    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 9, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    model = tiny_model("llama")
    expected = model.generate(**kwargs, **{cache_kwarg(): DynamicCache(config=model.config)})
    assert fuse_projections(model)
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True  # compile on the CPU too
    torch._dynamo.reset()
    cache = PagedCache(model, block_size=8, max_cache_len=16)
    out = model.generate(**kwargs, compile_config=config, **{cache_kwarg(): cache})
    assert model._compiled_call is not None
    assert torch.equal(out, expected)
