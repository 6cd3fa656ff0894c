"""Runs one scheduled step of any HF causal LM as a single flat forward over the paged KV pool.

Step, in order:
  1. block movements the scheduler asked for: swap out, swap in, copy-on-write copies; the block-table
     diffs go into the runner's persistent tables (hf_paged.core.planner.BlockTables);
  2. plan (CPU, vectorised: hf_paged.core.planner.plan_chunks): the flat batch ``input_ids [1, T]`` /
     ``position_ids [1, T]`` of every scheduled chunk (decode tokens first, then prefill chunks), each
     token's slot, the block tables, the lengths, and the indices of the positions that sample;
  3. run: the model's forward with ``use_cache=False`` inside ``forward_context``: the "paged"
     attention function writes each layer's K/V at the slots and reads the blocks; logits are
     computed only at the sampling positions (``logits_to_keep`` with indices).

CUDA graphs (hf_paged.engine.cuda_graphs): every step that fits a bucket replays a graph captured at start-up;
steps above the largest bucket run eagerly.

Shared-prefix ("cascade") decode (``cascade_attention``; on by default on CUDA): when the single-token rows of a
step hold the same leading physical blocks (a common prompt prefix with prefix caching, the ``n`` samples of one
prompt), their attention reads those blocks once per KV head for all rows (kernels/cascade.py) instead of once per
row. The runner finds that prefix from the step's block tables (``shared_prefix_blocks``), keeps it when the reads
it saves are worth the prefix kernel's fixed cost (``cascade_min_saved_bytes``), and hands its length to the
attention as a device value: a static input of the graphs, a small tensor for an eager decode step. Steps without a
shared prefix worth it run as in an engine without cascade (a plain decode graph).

Before compiling (hf_paged.engine.compile), the runner merges the model's sibling projections (q/k/v, gate/up) into
one GEMM each, in place (hf_paged.engine.fuse; ``fuse_projections``, on CUDA by default): a small model's decode step
is mostly ~5 µs kernels, three fewer a layer. The logits come back in the model's dtype: greedy rows take their
argmax directly.

Nothing here waits for the device: inputs go up through pinned staging copies (hf_paged.core.transfer),
and an input token that the previous step sampled but the host has not seen yet (a ``PLACEHOLDER``, async
scheduling) is copied into the input ids on the device from that step's sampled-token tensor.
"""

import numpy as np
import torch

from hf_paged.core.context import ForwardContext, forward_context
from hf_paged.core.kv_pool import KVPool
from hf_paged.core.planner import BlockTables, ForwardPlan, plan_chunks, shared_prefix_blocks, to_context
from hf_paged.core.transfer import to_device
from hf_paged.engine.compile import compile_layers, resolve_compile_mode, uncompile_layers
from hf_paged.engine.cuda_graphs import GRAPH_BATCH_SIZES, MIXED_TOKEN_SIZES, CudaGraphSteps, StaticInputs
from hf_paged.engine.fuse import fuse_projections as fuse_projections_in_place
from hf_paged.engine.scheduler import SchedulerOutput

__all__ = ["CASCADE_MIN_SAVED_BYTES", "ModelRunner"]


def _keep_on_own_device(model: torch.nn.Module, key: str) -> None:
    """Stop accelerate's top-level hook (device_map) from moving ``key`` to the first device.

    The indices of ``logits_to_keep`` index the hidden states where the last layer left them, on the
    ``lm_head``'s device; the hook would move them to the first GPU.
    """
    hook = getattr(model, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        if hasattr(h, "skip_keys"):
            keys = h.skip_keys if isinstance(h.skip_keys, (list, tuple)) else ([h.skip_keys] if h.skip_keys else [])
            if key not in keys:
                h.skip_keys = [*keys, key]


# Shared-prefix decode runs when the K/V bytes it saves in a layer, (decode rows - 1) x prefix tokens x K/V bytes of a
# token, reach this: below it the prefix kernel's fixed cost and the per-row partials outweigh the saved reads (with
# 4 KiB of K/V a token a layer: 48 rows of a 336-token prefix; fastest setting of the prefix workload on H100/H200).
CASCADE_MIN_SAVED_BYTES = 64 << 20


class ModelRunner(CudaGraphSteps):
    """Owns the model's forward for the engine.

    Args:
        model: a Hugging Face causal LM set to attn_implementation="paged".
        kv: the per-layer block pools.
        block_size: tokens per block.
        max_num_seqs: the most sequences in a step (the largest decode bucket).
        max_model_len: the longest sequence (width of the static block tables).
        max_num_batched_tokens: the most tokens in a step (the largest mixed bucket, capped at 8192: longer
            steps run eagerly, where the host's share of the step is small).
        use_cuda_graphs: replay CUDA graphs for steps that fit a bucket (CUDA only; default: on when on CUDA).
        compile_model: None (auto: ``auto_compile_mode()`` when graphs are on), False, "layers" (compile each
            decoder layer in place) or "full"/True (compile the whole forward inside the graphs); CUDA only
            (hf_paged.engine.compile).
        emulate_graphs: run each step that fits a bucket eagerly through the padded static inputs its graph would
            read, without capturing (tests the bucketing and padding on the CPU).
        cascade_attention: shared-prefix decode for steps whose decode rows share leading blocks (see the module
            docstring); a second decode graph a batch size is captured with it.
        cascade_min_saved_bytes: the K/V bytes a step's shared prefix must save in a layer to be used (default
            ``CASCADE_MIN_SAVED_BYTES``); 0 uses it whenever two decode rows share a block.
        fuse_projections: merge the q/k/v and gate/up ``nn.Linear`` modules of the model into one GEMM each, in
            place (hf_paged.engine.fuse); None = on CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVPool,
        block_size: int,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        max_num_batched_tokens: int = 2048,
        use_cuda_graphs: bool | None = None,
        compile_model: bool | str | None = False,
        emulate_graphs: bool = False,
        cascade_attention: bool = False,
        fuse_projections: bool | None = None,
        cascade_min_saved_bytes: int = CASCADE_MIN_SAVED_BYTES,
    ):
        self.model = model
        self.device = kv.k_cache[0].device
        self.input_device = model.get_input_embeddings().weight.device
        single_device = all(k.device == self.device for k in kv.k_cache) and self.input_device == self.device
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda" and single_device
        self.compile_mode = resolve_compile_mode(compile_model, use_cuda_graphs, self.device)  # what runs
        if fuse_projections is None:
            fuse_projections = self.device.type == "cuda"
        self.fused_groups = fuse_projections_in_place(model) if fuse_projections else []  # before compiling
        self.compiled_modules = compile_layers(model) if self.compile_mode == "layers" else []
        # "full": torch.compile fuses the model's elementwise ops (norms, rotary, activations) between the attention
        # calls, which stay eager (the attention function is excluded from tracing). Only the captured graphs use
        # it: eager steps have unbounded shapes and would keep recompiling.
        self._graph_forward = torch.compile(model, dynamic=True) if self.compile_mode == "full" else model
        self.kv = kv
        self.block_size = block_size
        head = model.get_output_embeddings()
        self.output_device = head.weight.device if head is not None else self.input_device  # logits_to_keep's
        _keep_on_own_device(model, "logits_to_keep")
        # (k_cache, v_cache, writes) a layer, as the attention reads them: a layer that shares an earlier layer's K/V
        # gets that layer's pools and does not write (an FP8 pool's scales reach the attention as ctx.kv_scales)
        self.kv_caches = [(k, v, kv.owns(i)) for i, (k, v) in enumerate(zip(kv.k_cache, kv.v_cache, strict=True))]
        # A 4D mask makes transformers skip building masks (the paged kernels take lengths, not masks);
        # it also keeps mask code with host syncs out of the captured graphs.
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.input_device)
        self.use_cuda_graphs = use_cuda_graphs
        self.emulate_graphs = emulate_graphs and not use_cuda_graphs
        self.max_num_seqs = max_num_seqs
        self.decode_sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})
        top = min(max_num_batched_tokens, MIXED_TOKEN_SIZES[-1])
        self.mixed_sizes = sorted({t for t in MIXED_TOKEN_SIZES if t < top} | {top})
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.tables = BlockTables(self.max_blocks_per_seq)  # kept from the scheduler's diffs
        self.cascade_attention = cascade_attention
        self.cascade_min_saved_bytes = cascade_min_saved_bytes
        # K and V bytes a layer's attention reads per token (the layers' mean, where their shapes differ)
        read = sum(s.num_kv_heads * (s.head_dim + (0 if s.v_in_k else s.v_head_dim)) for s in kv.layers)
        self._kv_bytes_per_token = read * kv.k_cache[0].element_size() // kv.num_layers
        self.num_cascade_steps = 0  # steps that ran with a shared prefix (for tests and metrics)
        self.graph_steps = {"decode": 0, "cascade": 0, "mixed": 0}  # steps run through each kind of graph (same)
        self._graphs: dict[tuple[str, int], tuple] = {}
        self._graph_pool = None
        self._capture_stream = None
        self._static: StaticInputs | None = None
        # (placeholders, source rows, input indices) of the last step with placeholders: a decode step's are
        # those of the step before while its sequences stay the same, so their index tensors are made once.
        self._placeholder_idx: tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor] | None = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run one step (queues the work on the device; never waits for it).

        Args:
            sched: the step, as the scheduler describes it.
            prev_sampled: [num_rows] int64 on the device, the tokens sampled by the previous step whose ids are
                not on the host yet: each ``sched.placeholders`` entry (flat index, row) reads its input id
                from ``prev_sampled[row]`` (async scheduling). None when no input is a placeholder.

        Returns:
            logits: [len(sched.sample_idx) + prompt log-prob rows, vocab_size] in the dtype the model computes them in
            (not copied to fp32: the sampler reads bf16 logits directly where no stage changes them), row r for
            sequence ``sched.sample_idx[r]``, then a row per token of ``sched.prompt_logprob_spans``; None for an empty
            step (its block movements and table diffs are still applied). A captured step's logits are a view of its
            graph's output buffer, which the next replay of that graph overwrites: read them on the current stream
            before then, as the sampler does.
        """
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        self.kv.copy_blocks(sched.copies)
        self.tables.apply(sched.block_updates)
        if sched.is_empty:
            return None
        plan = plan_chunks(
            self.tables.gather(sched.seq_ids),
            np.array(sched.num_computed, dtype=np.int64),
            np.array(sched.num_new_tokens, dtype=np.int64),
            np.array(sched.sample_idx, dtype=np.int64),
            self.block_size,
        )
        input_ids = np.array(sched.input_token_ids, dtype=np.int64)
        logits_idx = plan.logits_idx
        if sched.prompt_logprob_spans:  # rows past the graphs' logits buffers: such a step runs eagerly
            starts = plan.cu_seqlens_q[:-1]
            extra = [np.arange(n, dtype=np.int64) + starts[i] + j for i, j, n in sched.prompt_logprob_spans]
            logits_idx = np.concatenate([logits_idx, *extra])
            bucket = None
        else:
            bucket = self.graph_bucket(len(sched.seq_ids), len(input_ids), len(sched.sample_idx))
        if bucket is not None:
            return self._run_static(bucket, plan, input_ids, sched.placeholders, prev_sampled)
        ctx = to_context(plan, self.device, batch_size=1, query_len=len(input_ids), paged=True, owner=self,
                         kv_caches=self.kv_caches, kv_scales=self.kv.kv_scales)  # fmt: skip
        if plan.max_query_len == 1:  # an eager decode step (a mixed one sends its decode rows to the prefill kernel)
            prefix_len = self._cascade_prefix_len(plan, len(plan.seq_lens))
            if prefix_len:
                ctx.prefix_len = to_device(np.array([prefix_len], dtype=np.int32), torch.int32, self.device)
                ctx.max_prefix_len = prefix_len
        input_ids_t = to_device(input_ids, torch.int64, self.input_device)
        self._fill_placeholders(input_ids_t, sched.placeholders, prev_sampled)
        with forward_context(ctx):
            out = self.model(
                input_ids=input_ids_t.unsqueeze(0),
                position_ids=to_device(plan.positions, torch.int64, self.input_device).unsqueeze(0),
                attention_mask=self._no_mask,
                use_cache=False,
                logits_to_keep=to_device(logits_idx, torch.int64, self.output_device),
            )
        return out.logits[0]

    def _fill_placeholders(self, input_ids: torch.Tensor, placeholders: list[tuple[int, int]], prev_sampled) -> None:
        """input_ids[idx] = prev_sampled[row] for each (idx, row), on the device (the ids never visit the host)."""
        if not placeholders:
            return
        if prev_sampled is None:
            raise RuntimeError("bug in hf_paged: a step input is a placeholder but no previous tokens were given")
        cached = self._placeholder_idx
        if (
            cached is None
            or cached[0] != placeholders
            or cached[1].device != prev_sampled.device
            or cached[2].device != input_ids.device
        ):
            dst, src = zip(*placeholders, strict=True)
            src_t = to_device(src, torch.int64, prev_sampled.device)
            dst_t = to_device(dst, torch.int64, input_ids.device)
            cached = self._placeholder_idx = (list(placeholders), src_t, dst_t)  # never written: reused while equal
        _, src_t, dst_t = cached
        input_ids.index_copy_(0, dst_t, prev_sampled.index_select(0, src_t).to(input_ids.device))

    def _cascade_prefix_len(self, plan: ForwardPlan, num_decode: int) -> int:
        """Tokens the step's first ``num_decode`` (single-token) rows read through shared-prefix decode; 0 = none.

        The blocks every such row holds (``shared_prefix_blocks``), when the K/V reads that saves in a layer reach
        ``cascade_min_saved_bytes``.
        """
        if not self.cascade_attention or num_decode < 2:
            return 0
        blocks = shared_prefix_blocks(plan.block_tables[:num_decode], plan.seq_lens[:num_decode], self.block_size)
        prefix_len = blocks * self.block_size
        saved = (num_decode - 1) * prefix_len * self._kv_bytes_per_token
        if prefix_len == 0 or saved < self.cascade_min_saved_bytes:
            return 0
        self.num_cascade_steps += 1
        return prefix_len

    @torch.inference_mode()
    def warmup(self, num_tokens: int, num_logits: int = 1) -> torch.Tensor:
        """One dummy prefill of ``num_tokens`` tokens at start-up; nothing is written to the pool.

        Returns the fp32 logits of its last ``num_logits`` positions (as a step with that many sampling rows).

        It compiles the prefill kernel, picks the GEMM algorithms of a full-budget step and grows the
        memory allocator to a full step's activations before the first request, so the first requests do
        not pay for it (and a budget too large for the memory left after the pool fails here, not mid-run).
        """
        num_tokens = max(1, min(num_tokens, self.max_model_len))
        dev = self.device
        ctx = ForwardContext(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),  # -1: never written
            block_tables=torch.zeros((1, -(-num_tokens // self.block_size)), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            batch_size=1,
            query_len=num_tokens,
            paged=True,
            owner=self,
            kv_caches=self.kv_caches,
            kv_scales=self.kv.kv_scales,
        )
        num_logits = max(1, min(num_logits, num_tokens))
        with forward_context(ctx):
            out = self.model(
                input_ids=torch.zeros((1, num_tokens), dtype=torch.int64, device=self.input_device),
                position_ids=torch.arange(num_tokens, device=self.input_device).unsqueeze(0),
                attention_mask=self._no_mask,
                use_cache=False,
                logits_to_keep=torch.arange(num_tokens - num_logits, num_tokens, device=self.output_device),
            )
        return out.logits[0].float()

    def drop_compile(self) -> None:
        """Run eagerly from now on (the model's layers get their own forwards back)."""
        uncompile_layers(self.compiled_modules)
        self.compiled_modules = []
        self._graph_forward = self.model
        self.compile_mode = None
