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

CUDA graphs: every step that fits a bucket replays a graph captured at start-up (the whole forward, attention
included), so a step costs the host one staging copy and one replay whatever it carries:
- a decode step (one token per sequence, every one sampling) replays the graph of the smallest batch bucket
  that holds it (``GRAPH_BATCH_SIZES``); attention takes the split-K decode kernel;
- any other step (prompt chunks, prefix hits, decode tokens mixed in) replays the graph of the smallest token
  bucket that holds it (``MIXED_TOKEN_SIZES``, up to ``max_num_batched_tokens``), with room for
  ``min(tokens, max_num_seqs)`` sequences; attention takes the varlen prefill kernel, whose grid depends
  only on the shapes (kernels/prefill.py), so one capture serves every mix of lengths.
Replay only stages the plan into static inputs (``StaticInputs``) and replays: the captured forward must stay
capturable (no host sync, no shape change). Padding tokens get slot -1 (never written) and belong to no
sequence (attention output 0); padding sequences are empty (length 0). Steps above the largest bucket run
eagerly.

Shared-prefix ("cascade") decode (``cascade_attention``; on by default on CUDA, see EngineConfig for the H100
measurement): when the single-token rows of a step hold the same leading physical blocks (a
common prompt prefix with prefix caching, the ``n`` samples of one prompt), their attention reads those blocks
once per KV head for all rows (kernels/cascade.py) instead of once per row. The runner finds that prefix from the
step's block tables (``shared_prefix_blocks``), keeps it when the reads it saves are worth the prefix kernel's
fixed cost (``CASCADE_MIN_SAVED_BYTES``), and hands its length to the attention as a device value: a static input
of the graphs, a small tensor for an eager decode step. Each decode batch size has two graphs then: the plain one
(the decode kernel writes the new K/V, no prefix kernel), replayed when the rows share no prefix worth it, and a
"cascade" one holding the prefix kernel, which replays with any length; the mixed graphs hold the prefix kernel
(length 0 = none). So the steps without a shared prefix run as in an engine without cascade, for one more decode
graph a batch size (its capture, and its logits buffer).

Before compiling, the runner merges the model's sibling projections (q/k/v, gate/up) into one GEMM each, in place
(hf_paged.engine.fuse; ``fuse_projections``, on CUDA by default): a small model's decode step is mostly ~5 µs
kernels, three fewer a layer. The logits come back in the model's dtype: greedy rows take their argmax directly.

Nothing here waits for the device: inputs go up through pinned staging copies (hf_paged.core.transfer),
and an input token that the previous step sampled but the host has not seen yet (a ``PLACEHOLDER``, async
scheduling) is copied into the input ids on the device from that step's sampled-token tensor.
"""

import gc

import numpy as np
import torch

from hf_paged.core.context import ForwardContext, forward_context
from hf_paged.engine.fuse import fuse_projections as fuse_projections_in_place
from hf_paged.engine.scheduler import SchedulerOutput
from hf_paged.core.kv_pool import KVPool
from hf_paged.core.planner import BlockTables, ForwardPlan, plan_chunks, shared_prefix_blocks, to_context
from hf_paged.core.transfer import to_device


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


# Graph buckets. Decode steps (one token per sequence, all sampling): padded to the next batch size here.
# Mixed steps (prompt chunks, possibly with decode tokens): padded to the next token count here, with room for
# min(tokens, max_num_seqs) sequences. Padding tokens attend to nothing but go through every GEMM, and above a few
# hundred tokens a step's GEMMs are compute-bound (an 8B model: ~21 µs a token on an H100), so the sizes step by 128
# from 256 to 1024 and by 256 to 1536, the tile height of the GEMMs: in the 8B sharegpt workload's schedule (199 mixed
# steps, steady-state ones carry ~256 decode rows and one new prompt: 263-700 tokens) that pads 12 896 tokens instead
# of 27 360 with sizes doubling from 256 (benchmarks/RESULTS.md, twelfth session). Each size is one more graph to
# capture and one more logits buffer of min(size, max_num_seqs) rows.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192)

# Shared-prefix decode runs when the KV bytes it saves in a layer, (decode rows - 1) x prefix tokens x K/V bytes of a
# token, reach this, above the fixed cost of the prefix kernel and one partial per row. Qwen3-0.6B (4 KiB of K/V a
# token a layer): 48 rows of a 336-token prefix, 200 rows from 82 shared tokens on. Measured: the thirteenth
# session's H100 trace of the prefix workload (336 shared tokens) had cascade steps of 17-32 rows ~0.13 ms slower
# than plain ones, 48-64 even, 80 and up faster; the sixteenth session's H200 A/B (run_gpu.sh cascade-bytes-ab, A B B
# A) ran the workload at 48 979 / 49 186 output tok/s with 64 MiB against 48 587 / 48 860 with the earlier 16 MiB.
CASCADE_MIN_SAVED_BYTES = 64 << 20


# compile_model="layers": each decoder layer (LlamaDecoderLayer, Qwen3DecoderLayer...) is compiled in place. The
# attention function is excluded from tracing, so a layer compiles into two pieces around it (projections, norms,
# rotary / output projection, residuals, MLP); all layers share the compiled code (same code, dynamic shapes).
# Eagerly a layer runs about 40 small kernels; compiled, a handful. Models without such classes compile their norms,
# MLPs and attention modules instead.
LAYER_SUFFIXES = ("DecoderLayer",)
AUTO_COMPILE_MODE = "layers"  # what compile_model=None means with CUDA graphs (the GPU tests set False: speed)
FALLBACK_SUFFIXES = ("RMSNorm", "MLP", "Attention")
# Extra torch.compile options for the layers (e.g. {"mode": "max-autotune-no-cudagraphs"}: Triton GEMM templates that
# can take the residual adds as epilogues, a few launches a layer fewer, autotuned at start-up). A module switch for
# benchmarks/module_ab.py (run_gpu.sh part autotune-ab); none by default.
LAYER_COMPILE_OPTIONS: dict = {}


def compile_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """torch.compile the forward of every decoder layer of ``model`` in place; returns the modules compiled."""
    compiled = []
    for suffixes in (LAYER_SUFFIXES, FALLBACK_SUFFIXES):
        for module in model.modules():
            if type(module).__name__.endswith(suffixes) and not getattr(module, "_hf_paged_compiled", False):
                module.forward = torch.compile(module.forward, dynamic=True, **LAYER_COMPILE_OPTIONS)
                module._hf_paged_compiled = True
                compiled.append(module)
        if compiled or any(getattr(m, "_hf_paged_compiled", False) for m in model.modules()):
            break
    return compiled


def uncompile_layers(modules: list[torch.nn.Module]) -> None:
    """Undo ``compile_layers``: the modules' class forwards again."""
    for module in modules:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_hf_paged_compiled", None)


class ModelRunner:
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
        compile_model: None (auto: "layers" when graphs are on), False, "layers" (compile each decoder layer in
            place) or "full"/True (compile the whole forward inside the graphs); CUDA only.
        emulate_graphs: run each step that fits a bucket eagerly through the padded static inputs its graph would
            read, without capturing (tests the bucketing and padding on the CPU).
        cascade_attention: shared-prefix decode for steps whose decode rows share leading blocks (see the module
            docstring); a second decode graph a batch size is captured with it. ``cascade_min_saved_bytes`` (default
            ``CASCADE_MIN_SAVED_BYTES``) is the threshold per step and layer; 0 uses it whenever two rows share a
            block.
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
    ):
        self.model = model
        self.device = kv.k_cache[0].device
        self.input_device = model.get_input_embeddings().weight.device
        single_device = all(k.device == self.device for k in kv.k_cache) and self.input_device == self.device
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda" and single_device
        if compile_model is None:  # auto
            compile_model = AUTO_COMPILE_MODE if use_cuda_graphs and self.device.type == "cuda" else False
        mode = "full" if compile_model is True else (compile_model or None)
        self.compile_mode = mode if self.device.type == "cuda" else None  # what runs; the CPU never compiles
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
        self.kv_caches = list(zip(kv.k_cache, kv.v_cache, strict=True))
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
        self.cascade_min_saved_bytes = CASCADE_MIN_SAVED_BYTES
        k0 = kv.k_cache[0]  # [num_blocks, block_size, num_kv_heads, head_dim]
        self._kv_bytes_per_token = 2 * k0.shape[2] * k0.shape[3] * k0.element_size()  # K and V, one layer
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
            logits: [len(sched.sample_idx), vocab_size] in the dtype the model computes them in (not copied to
            fp32: the sampler reads bf16 logits directly where no stage changes them), row r for sequence
            ``sched.sample_idx[r]``; None for an empty step (its block movements and table diffs are still
            applied). A captured step's logits are a view of its graph's output buffer, which the next replay of
            that graph overwrites: read them on the current stream before then, as the sampler does.
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
        bucket = self._bucket(len(sched.seq_ids), len(input_ids), len(sched.sample_idx))
        if bucket is not None:
            return self._run_static(bucket, plan, input_ids, sched.placeholders, prev_sampled)
        ctx = to_context(plan, self.device, batch_size=1, query_len=len(input_ids), paged=True, owner=self,
                         kv_caches=self.kv_caches)  # fmt: skip
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
                logits_to_keep=to_device(plan.logits_idx, torch.int64, self.output_device),
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

    # ---- CUDA graphs: static, padded inputs --------------------------------------------------------

    def _bucket(self, num_seqs: int, num_tokens: int, num_sampling: int) -> tuple[str, int] | None:
        """The graph that runs this step: ("decode", batch) or ("mixed", tokens); None = eager. (A decode step whose
        rows share a prefix replays ("cascade", batch) instead: ``_run_static`` finds the prefix.)"""
        if not (self.use_cuda_graphs or self.emulate_graphs) or num_seqs > self.max_num_seqs:
            return None
        if num_tokens == num_seqs and num_sampling == num_seqs:  # decode only: the split-K decode kernel
            return "decode", next(b for b in self.decode_sizes if b >= num_seqs)
        if num_tokens <= self.mixed_sizes[-1]:
            return "mixed", next(t for t in self.mixed_sizes if t >= num_tokens)
        return None

    def _bucket_shape(self, bucket: tuple[str, int]) -> tuple[int, int]:
        """(padded tokens, padded sequences) of a bucket."""
        kind, size = bucket
        return (size, size) if kind != "mixed" else (size, min(size, self.max_num_seqs))

    def _run_static(self, bucket, plan: ForwardPlan, input_ids: np.ndarray, placeholders, prev_sampled):
        """Stage the step's plan into the static inputs, padded to its bucket, and replay the bucket's graph.

        Padding: tokens past the real ones get id 0, position 0 and slot -1 (never written) and belong to no
        sequence (attention output 0); sequences past the real ones are empty (no token, length 0); logits rows
        past the sampling ones read token 0 and are dropped.
        """
        if self._static is None:
            self._allocate_static()
        st = self._static
        num_tokens, num_seqs, num_sampling = len(input_ids), len(plan.seq_lens), len(plan.logits_idx)
        pad_tokens, pad_seqs = self._bucket_shape(bucket)
        host = st.stage()  # numpy views of a free pinned staging buffer
        np.maximum(input_ids, 0, out=host["input_ids"][:num_tokens])  # placeholders are filled on the device below
        host["input_ids"][num_tokens:pad_tokens] = 0
        host["position_ids"][:num_tokens] = plan.positions
        host["position_ids"][num_tokens:pad_tokens] = 0
        host["slot_mapping"][:num_tokens] = plan.slot_mapping
        host["slot_mapping"][num_tokens:pad_tokens] = -1
        host["logits_idx"][:num_sampling] = plan.logits_idx
        host["logits_idx"][num_sampling:pad_seqs] = 0
        host["seq_lens"][:num_seqs] = plan.seq_lens
        host["seq_lens"][num_seqs:pad_seqs] = 0
        host["cu_seqlens_q"][: num_seqs + 1] = plan.cu_seqlens_q
        host["cu_seqlens_q"][num_seqs + 1 : pad_seqs + 1] = num_tokens
        num_decode = num_seqs
        if bucket[0] == "mixed":  # the leading single-token sequences go to the decode kernel
            single = plan.cu_seqlens_q[1:] - plan.cu_seqlens_q[:-1] == 1
            num_decode = num_seqs if single.all() else int(np.argmin(single))
            host["decode_seq_lens"][:num_decode] = plan.seq_lens[:num_decode]
            host["decode_seq_lens"][num_decode:pad_seqs] = 0
            np.maximum(plan.cu_seqlens_q, num_decode, out=host["prefill_cu_seqlens_q"][: num_seqs + 1])
            host["prefill_cu_seqlens_q"][num_seqs + 1 : pad_seqs + 1] = num_tokens
        prefix_len = host["prefix_len"][0] = self._cascade_prefix_len(plan, num_decode)
        if prefix_len and bucket[0] == "decode":  # the decode graph that holds the shared-prefix kernel
            bucket = ("cascade", bucket[1])
        self.graph_steps[bucket[0]] += 1
        width = plan.block_tables.shape[1]
        host["block_tables"][: num_seqs * width] = plan.block_tables.ravel()
        st.upload(num_seqs, width)
        self._fill_placeholders(st.dev["input_ids"], placeholders, prev_sampled)
        if self.emulate_graphs:
            logits = self._static_forward(bucket)()
        else:
            if bucket not in self._graphs:
                self._capture(bucket)
            graph, logits = self._graphs[bucket]
            graph.replay()
        return logits[0, :num_sampling]

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

    def clear_graphs(self) -> None:
        """Forget captured graphs (a capture is redone); graphs stay on."""
        self._graphs.clear()
        self._graph_pool = None

    def release_graphs(self) -> None:
        """Free the captured graphs and their buffers; later decode steps run eagerly.

        Under tensor parallelism the graphs hold captured NCCL work, and ``destroy_process_group()`` hangs
        while they are alive (pytorch/pytorch#115388).
        """
        self._graphs.clear()
        self._graph_pool = None
        self._static = None
        self.use_cuda_graphs = self.emulate_graphs = False

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (smaller graphs reuse its memory pool): mixed, then decode.

        Under inference mode, as every forward of the runner: with autograd on, each graph's logits would keep
        the whole forward's activations alive for a backward that never comes (about 1 MiB a token for a
        0.6B model: 8.6 GiB for the default buckets).
        """
        if self._static is None:
            self._allocate_static()
        for bucket in sorted(self._all_buckets(), key=lambda b: self._bucket_shape(b), reverse=True):
            if bucket not in self._graphs:
                self._capture(bucket)

    def _allocate_static(self) -> None:
        max_tokens = max(self.mixed_sizes[-1], self.decode_sizes[-1])
        self._static = StaticInputs(max_tokens, self.max_num_seqs, self.max_blocks_per_seq, self.device)

    def _static_forward(self, bucket: tuple[str, int]):
        """The forward of ``bucket`` over views of the static inputs (what its graph captures)."""
        kind, _ = bucket
        pad_tokens, pad_seqs = self._bucket_shape(bucket)
        dev = self._static.dev
        ctx = ForwardContext(
            slot_mapping=dev["slot_mapping"][:pad_tokens],
            block_tables=dev["block_tables"][:pad_seqs],
            seq_lens=dev["seq_lens"][:pad_seqs],
            cu_seqlens_q=dev["cu_seqlens_q"][: pad_seqs + 1],
            # Host hints fixed for the bucket. Decode: the split count must not change between replays. Mixed:
            # BLOCK_M for the longest query the bucket can hold; the prefill grid comes from the shapes.
            max_query_len=pad_tokens if kind == "mixed" else 1,
            max_seq_len=self.max_model_len,
            batch_size=1,
            query_len=pad_tokens,
            paged=True,
            owner=self,
            kv_caches=self.kv_caches,
        )
        if self.cascade_attention and kind != "decode":  # the graph holds the prefix kernel; each replay reads the
            ctx.prefix_len = dev["prefix_len"]  # step's length (0 = none)
            ctx.max_prefix_len = self.max_model_len
        if kind == "mixed":
            # Decode rows through the prefill kernel would each take a whole BLOCK_M tile and its pipeline ramp
            # (about 3 ms a step at 256 rows, 28 layers): they take the split-K decode kernel instead.
            ctx.decode_seq_lens = dev["decode_seq_lens"][:pad_seqs]
            ctx.decode_cu_seqlens_q = dev["decode_cu_seqlens_q"][: pad_seqs + 1]
            ctx.prefill_cu_seqlens_q = dev["prefill_cu_seqlens_q"][: pad_seqs + 1]
        model = self.model if self.emulate_graphs else self._graph_forward

        def forward():
            with forward_context(ctx):
                return model(
                    input_ids=dev["input_ids"][:pad_tokens].unsqueeze(0),
                    position_ids=dev["position_ids"][:pad_tokens].unsqueeze(0),
                    attention_mask=self._no_mask,
                    use_cache=False,
                    logits_to_keep=dev["logits_idx"][:pad_seqs],
                ).logits

        return forward

    def graph_output_bytes(self) -> int:
        """Bytes of the logits every captured graph keeps as its output (they live as long as the graphs)."""
        head = self.model.get_output_embeddings()
        if not self.use_cuda_graphs or head is None:
            return 0
        rows = sum(self._bucket_shape(b)[1] for b in self._all_buckets())
        return rows * head.weight.shape[0] * head.weight.element_size()

    def _all_buckets(self) -> list[tuple[str, int]]:
        cascade = [("cascade", b) for b in self.decode_sizes] if self.cascade_attention else []
        return [("mixed", t) for t in self.mixed_sizes] + [("decode", b) for b in self.decode_sizes] + cascade

    @torch.inference_mode()
    def _capture(self, bucket: tuple[str, int]) -> None:
        """Capture the forward of ``bucket`` (after one eager warm-up run)."""
        forward = self._static_forward(bucket)
        # The live rows were just written; the warm-up may rewrite their slots with the same K/V.
        # One side stream for every warm-up: the allocator caches freed blocks per stream, so a new stream per
        # capture would strand each warm-up's activations (a 8192-token bucket's are over a GiB).
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()  # compiles Triton kernels, creates cuBLAS handles, outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: collecting an unreachable engine frees its CUDA graphs, and a
        # graph's reset is not permitted while a stream captures: it invalidates this capture ("operation failed
        # due to a previous error during capture"; seen in the GPU test run, engines of earlier tests in cycles).
        # What is unreachable meanwhile is collected after the capture, by the next automatic collection.
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                logits = forward()
        finally:
            if gc_enabled:
                gc.enable()
        self._graph_pool = graph.pool()
        self._graphs[bucket] = (graph, logits)


class StaticInputs:
    """The captured steps' inputs: static device tensors, filled each step from double-buffered pinned staging.

    Every graph reads views of the same device tensors (a bucket of T tokens and S sequences reads the first T
    and S entries). A step writes its padded plan into the numpy views of one pinned host buffer (``stage()``)
    and ``upload()`` queues three asynchronous copies: no allocation and no sync per step. The two staging
    buffers alternate; a buffer is reused only after the copies that read it two steps ago have run (an event).

    Args:
        max_tokens: tokens of the largest bucket.
        max_seqs: sequences of the largest bucket.
        max_blocks_per_seq: block-table width.
        device: where the graphs run.
    """

    # (name, dtype, length as a function of (max_tokens, max_seqs)): packed into one int64 and one int32 buffer.
    I64 = (("input_ids", "T"), ("position_ids", "T"), ("slot_mapping", "T"), ("logits_idx", "S"))
    I32 = (
        ("seq_lens", "S"),
        ("cu_seqlens_q", "S1"),
        ("decode_seq_lens", "S"),
        ("prefill_cu_seqlens_q", "S1"),
        ("prefix_len", "1"),  # shared-prefix decode: tokens every decode row shares (0 = none)
    )

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        sizes = {"T": max_tokens, "S": max_seqs, "S1": max_seqs + 1, "1": 1}
        self.device = device
        pin = device.type == "cuda"
        self._layout = {}
        self.dev: dict[str, torch.Tensor] = {}
        self._dev_packed = {}
        for dtype, fields in ((torch.int64, self.I64), (torch.int32, self.I32)):
            total = sum(sizes[n] for _, n in fields)
            packed = torch.zeros(total, dtype=dtype, device=device)
            self._dev_packed[dtype] = packed
            offset = 0
            for name, n in fields:
                self._layout[name] = (dtype, offset, sizes[n])
                self.dev[name] = packed[offset : offset + sizes[n]]
                offset += sizes[n]
        self.dev["slot_mapping"].fill_(-1)
        self.dev["decode_cu_seqlens_q"] = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)  # constant
        self.dev["block_tables"] = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self._host = []  # two staging buffers: {dtype: pinned packed tensor, "block_tables": pinned flat}
        for _ in range(2):
            buf = {dtype: torch.zeros(p.numel(), dtype=dtype, pin_memory=pin) for dtype, p in self._dev_packed.items()}
            buf["block_tables"] = torch.zeros(max_seqs * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
            views = {name: buf[dtype].numpy()[off : off + n] for name, (dtype, off, n) in self._layout.items()}
            views["block_tables"] = buf["block_tables"].numpy()
            self._host.append((buf, views, torch.cuda.Event() if pin else None))
        self._turn = 0

    def stage(self) -> dict[str, np.ndarray]:
        """The numpy views of the next free staging buffer (waits, rarely, for its copies of two steps ago)."""
        self._turn ^= 1
        _, views, event = self._host[self._turn]
        if event is not None:
            event.synchronize()
        return views

    def upload(self, num_seqs: int, width: int) -> None:
        """Queue the copies of the staged step: the packed buffers whole, the block tables' first rows."""
        buf, _, event = self._host[self._turn]
        for dtype, packed in self._dev_packed.items():
            packed.copy_(buf[dtype], non_blocking=True)
        rows = buf["block_tables"][: num_seqs * width].view(num_seqs, width)
        self.dev["block_tables"][:num_seqs, :width].copy_(rows, non_blocking=True)
        if event is not None:
            event.record()
