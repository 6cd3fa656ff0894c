"""Host time of one attention layer's cache update + attention call in an eager decode step, on the GPU's host.

An eager ``model.generate`` decode step of a small model is bound by the host (benchmarks/RESULTS.md): whatever the
cache and the attention function cost in Python and dispatch, per layer, is paid on every step. This script times
exactly that part, outside any model, with CUDA tensors of a model shape:

- ``dynamic``: ``DynamicCache.update`` (two concatenations) + transformers' ``sdpa_attention_forward``;
- ``paged``: ``PagedCache.update`` (which defers the K/V write) + ``paged_attention_forward`` (one decode launch that
  writes and attends), inside a decode step's forward context planned by the cache itself;
- ``plan``: the cache's per-forward work of that decode step (``_begin_forward`` and ``_end_forward``: blocks, slots,
  lengths, the host copies and their syncs), once a step rather than once a layer.

Each repeat issues ``--calls`` calls and takes the host's time to issue them (no sync inside; the queue never fills:
the GPU keeps up), divided by the calls; the table gives the minimum over ``--repeats`` and the median (a shared host
only ever adds time, so the minimum is the steadier figure). The DynamicCache's length is put back after every call,
so both read the same context.

Run (CUDA): python benchmarks/layer_host_time.py [--shape llama-8b] [--batch 64] [--context 512]
"""

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_paged import PagedCache
from hf_paged.core.attention import paged_attention_forward
from hf_paged.core.context import reset_forward_context, set_forward_context
from hf_paged.frontends.bench import SHAPES, build_model


def issue_us(step, calls: int, repeats: int) -> list[float]:
    """Host µs per call of ``step()``, one figure per repeat (synced between repeats, not inside)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step()
    sync()
    figures = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        figures.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (the CPU references, not the CUDA host)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (the costs it times are the CUDA host's); --device cpu for a smoke run")
    device = args.device
    model = build_model(args.shape, device, num_hidden_layers=1)  # one layer: its attention module and heads
    attn = model.model.layers[0].self_attn
    config = model.config
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    batch, context = args.batch, args.context
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = next(model.parameters()).dtype

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    q = rand(batch, num_heads, 1, head_dim)
    k, v = rand(batch, num_kv_heads, 1, head_dim), rand(batch, num_kv_heads, 1, head_dim)
    scaling = head_dim**-0.5

    dynamic = DynamicCache(config=config)
    dynamic.update(rand(batch, num_kv_heads, context, head_dim), rand(batch, num_kv_heads, context, head_dim), 0)
    layer = dynamic.layers[0]
    keys0, values0 = layer.keys, layer.values

    def dynamic_step():
        keys, values = dynamic.update(k, v, 0)
        sdpa_attention_forward(attn, q, keys, values, None, dropout=0.0, scaling=scaling)
        layer.keys, layer.values = keys0, values0

    model.set_attn_implementation("paged")
    paged = PagedCache(model)
    prompts = torch.randint(3, config.vocab_size, (batch, context), device=device, generator=gen)
    with torch.no_grad():
        model(input_ids=prompts, past_key_values=paged)  # the prefill: every row holds `context` tokens
    next_ids = torch.randint(3, config.vocab_size, (batch, 1), device=device, generator=gen)

    def plan_step():  # one decode step's plan and end, without the forward (each appends a token to every row)
        paged._begin_forward(next_ids, (batch, 1), None)
        paged._end_forward(completed=True)

    ctx = paged._begin_forward(next_ids, (batch, 1), None)
    token = set_forward_context(ctx)
    try:

        def paged_step():
            k_cache, v_cache = paged.update(k, v, 0)
            paged_attention_forward(attn, q, k_cache, v_cache, None, scaling=scaling)

        results = {"dynamic": [], "paged": []}
        for _ in range(2):  # alternating halves: both see the same host load
            results["dynamic"] += issue_us(dynamic_step, args.calls, args.repeats // 2)
            results["paged"] += issue_us(paged_step, args.calls, args.repeats // 2)
    finally:
        reset_forward_context(token)
        paged._end_forward(completed=True)
    results["plan"] = issue_us(plan_step, 1, args.repeats)
    card = torch.cuda.get_device_name() if device == "cuda" else device
    print(
        f"{args.shape}, batch {batch}, context {context}, {card}: host µs a call, min "
        f"(median) of {args.repeats} repeats of {args.calls} calls (plan: 1 call a repeat)"
    )
    print("| per layer: DynamicCache + sdpa | per layer: PagedCache + paged | per step: PagedCache's plan |")
    print("|---:|---:|---:|")
    cells = [f"{min(results[n]):.1f} ({statistics.median(results[n]):.1f})" for n in ("dynamic", "paged", "plan")]
    print(f"| {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
