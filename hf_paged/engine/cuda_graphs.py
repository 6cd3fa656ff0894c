"""CUDA graphs of the model runner: every step that fits a bucket replays a graph captured at start-up.

The whole forward is captured, attention included, so a step costs the host one staging copy and one replay
whatever it carries:
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

With shared-prefix decode each decode batch size has two graphs: the plain one, and a "cascade" one holding the
prefix kernel, which replays with any prefix length (a static input); the mixed graphs hold the prefix kernel
(length 0 = none).
"""

import gc

import numpy as np
import torch

from hf_paged.core.context import ForwardContext, forward_context
from hf_paged.core.planner import ForwardPlan

# Decode buckets: a decode step is padded to the next batch size here (each size is one more graph to capture and
# one more logits buffer).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Mixed buckets: a step is padded to the next token count here, with room for min(tokens, max_num_seqs) sequences.
# Padding tokens go through every GEMM, and above a few hundred tokens a step's GEMMs are compute-bound, so from 256
# the sizes step by the GEMMs' 128-row tile (by 256 from 1024): about half the padding of sizes doubling from 256 on
# a serving workload's mixed steps.
MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192)


class CudaGraphSteps:
    """The CUDA-graph half of ``ModelRunner`` (a base class: its attributes are set by the runner's constructor).

    Reads ``model``, ``device``, ``kv``, ``kv_caches``, ``max_model_len``, ``max_num_seqs``, ``max_blocks_per_seq``,
    ``decode_sizes``, ``mixed_sizes``, ``cascade_attention``, ``use_cuda_graphs``, ``emulate_graphs``,
    ``_graph_forward`` (the model, or its compiled forward), ``_no_mask``, ``_cascade_prefix_len`` and
    ``_fill_placeholders``; owns ``_graphs`` (bucket -> (graph, logits)), ``_graph_pool``, ``_capture_stream``,
    ``_static`` (the static inputs) and ``graph_steps`` (steps run through each kind of graph).
    """

    def graph_bucket(self, num_seqs: int, num_tokens: int, num_sampling: int) -> tuple[str, int] | None:
        """The graph that runs this step: ("decode", batch) or ("mixed", tokens); None = eager. (A decode step whose
        rows share a prefix replays ("cascade", batch) instead: ``_run_static`` finds the prefix.)"""
        if not (self.use_cuda_graphs or self.emulate_graphs) or num_seqs > self.max_num_seqs:
            return None
        if num_tokens == num_seqs and num_sampling == num_seqs:  # decode only: the split-K decode kernel
            return "decode", next(b for b in self.decode_sizes if b >= num_seqs)
        if num_tokens <= self.mixed_sizes[-1]:
            return "mixed", next(t for t in self.mixed_sizes if t >= num_tokens)
        return None

    def bucket_shape(self, bucket: tuple[str, int]) -> tuple[int, int]:
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
        pad_tokens, pad_seqs = self.bucket_shape(bucket)
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
        for bucket in sorted(self._all_buckets(), key=lambda b: self.bucket_shape(b), reverse=True):
            if bucket not in self._graphs:
                self._capture(bucket)

    def _allocate_static(self) -> None:
        max_tokens = max(self.mixed_sizes[-1], self.decode_sizes[-1])
        self._static = StaticInputs(max_tokens, self.max_num_seqs, self.max_blocks_per_seq, self.device)

    def _static_forward(self, bucket: tuple[str, int]):
        """The forward of ``bucket`` over views of the static inputs (what its graph captures)."""
        kind, _ = bucket
        pad_tokens, pad_seqs = self.bucket_shape(bucket)
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
            kv_scales=self.kv.kv_scales,  # an FP8 pool's: fixed tensors, read by address on every replay
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
        rows = sum(self.bucket_shape(b)[1] for b in self._all_buckets())
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
        # due to a previous error during capture"). What is unreachable meanwhile is collected after the capture,
        # by the next automatic collection.
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
