"""Runs one scheduled step of any HF causal LM as a single flat forward over the paged KV pool.

Step, in order:
  1. block movements the scheduler asked for: swap out, swap in, copy-on-write copies;
  2. plan (CPU): the flat batch ``input_ids [1, T]`` / ``position_ids [1, T]`` of every scheduled chunk
     (decode tokens first, then prefill chunks), each token's slot, the block tables, the lengths, and
     the indices of the positions that sample;
  3. run: the model's forward with ``use_cache=False`` inside ``forward_context``: the "paged"
     attention function writes each layer's K/V at the slots and reads the blocks; logits are
     computed only at the sampling positions (``logits_to_keep`` with indices).

CUDA graphs: a step of decode tokens only (one token per sequence, every one sampling) replays a graph
captured for the smallest batch bucket that holds it (``GRAPH_BATCH_SIZES``; the engine captures every
bucket at start-up). Run only copies the plan into static buffers and replays: it must stay capturable
(no host sync, no shape change). Padding rows of a bucket get slot -1 (never written) and length 0
(output zeros). Prefill and mixed steps run eagerly.

Nothing here waits for the device: inputs go up through pinned staging copies (hf_paged.engine.transfer),
and an input token that the previous step sampled but the host has not seen yet (a ``PLACEHOLDER``, async
scheduling) is copied into the input ids on the device from that step's sampled-token tensor.
"""

import itertools

import numpy as np
import torch

from hf_paged.context import ForwardContext, forward_context
from hf_paged.engine.scheduler import SchedulerOutput
from hf_paged.transfer import to_device
from hf_paged.kv_pool import KVPool


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


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class ModelRunner:
    """Owns the model's forward for the engine.

    Args:
        model: a Hugging Face causal LM set to attn_implementation="paged".
        kv: the per-layer block pools.
        block_size: tokens per block.
        max_num_seqs: the largest decode batch (the largest graph bucket).
        max_model_len: the longest sequence (width of the static block tables).
        use_cuda_graphs: replay CUDA graphs for decode steps (CUDA only; default: on when on CUDA).
        compile_model: compile the model (torch.compile) inside the decode graphs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVPool,
        block_size: int,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        use_cuda_graphs: bool | None = None,
        compile_model: bool = False,
    ):
        self.model = model
        # torch.compile fuses the model's elementwise ops (norms, rotary, activations) between the attention
        # calls, which stay eager (the attention function is excluded from tracing). Only the captured decode
        # graphs use it: prefill lengths vary without bound and would keep recompiling.
        self._graph_forward = torch.compile(model, dynamic=True) if compile_model else model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.k_cache[0].device
        self.input_device = model.get_input_embeddings().weight.device
        head = model.get_output_embeddings()
        self.output_device = head.weight.device if head is not None else self.input_device  # logits_to_keep's
        _keep_on_own_device(model, "logits_to_keep")
        self.kv_caches = list(zip(kv.k_cache, kv.v_cache, strict=True))
        # A 4D mask makes transformers skip building masks (the paged kernels take lengths, not masks);
        # it also keeps mask code with host syncs out of the captured graphs.
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.input_device)
        single_device = all(k.device == self.device for k in kv.k_cache) and self.input_device == self.device
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda" and single_device
        self.use_cuda_graphs = use_cuda_graphs
        self.graph_sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None
        self._static = None

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, block_tables: list[list[int]], prev_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one step (queues the work on the device; never waits for it).

        Args:
            sched: the step (chunks in batch order, block movements).
            block_tables: the block table of each chunk's sequence, in chunk order.
            prev_tokens: [num_rows] int64 on the device, the tokens sampled by the previous step, whose ids
                are not on the host yet: an input that is a ``PLACEHOLDER`` of sequence ``seq`` is read from
                ``prev_tokens[seq.sample_row]`` (async scheduling). None when no input is a placeholder.

        Returns:
            logits: [num_sampling_chunks, vocab_size] fp32, one row per chunk whose ``samples`` is True,
            in chunk order.
        """
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        self.kv.copy_blocks(sched.copies)
        num_seqs = len(sched.chunks)
        if (
            self.use_cuda_graphs
            and num_seqs <= self.graph_sizes[-1]
            and sched.num_batched_tokens == num_seqs
            and all(c.samples for c in sched.chunks)
        ):
            return self._replay(sched, block_tables, prev_tokens)
        ctx, input_ids, position_ids, logits_idx = self._plan(sched, block_tables, prev_tokens)
        with forward_context(ctx):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=self._no_mask,
                use_cache=False,
                logits_to_keep=logits_idx,
            )
        return out.logits[0].float()

    def _fill_placeholders(self, input_ids: torch.Tensor, dst: list[int], src: list[int], prev_tokens) -> None:
        """input_ids[dst[i]] = prev_tokens[src[i]], on the device (the ids never visit the host)."""
        if not dst:
            return
        if prev_tokens is None:
            raise RuntimeError("bug in hf_paged: a step input is a placeholder but no previous tokens were given")
        dev = prev_tokens.device
        values = prev_tokens.index_select(0, to_device(src, torch.int64, dev)).to(input_ids.device)
        input_ids.index_copy_(0, to_device(dst, torch.int64, input_ids.device), values)

    # ---- CUDA graphs for decode steps --------------------------------------------------------------

    def _replay(self, sched: SchedulerOutput, block_tables: list[list[int]], prev_tokens) -> torch.Tensor:
        """Copy the decode step into the static buffers and replay the bucket's graph."""
        num_seqs = len(sched.chunks)
        bucket = next(b for b in self.graph_sizes if b >= num_seqs)
        if self._static is None:
            self._allocate_static()
        st = self._static
        bs = self.block_size
        ids = [c.seq.token_ids[c.start] for c in sched.chunks]
        dst = [i for i, t in enumerate(ids) if t < 0]  # placeholders: read from prev_tokens on the device
        src = [sched.chunks[i].seq.sample_row for i in dst]
        positions = [c.start for c in sched.chunks]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions, strict=True)]
        width = max(len(t) for t in block_tables)
        host = st["host"]
        host["ids"][:num_seqs] = ids
        host["ids"][num_seqs:bucket] = 0  # padding rows: a valid id (an old placeholder here would be -1)
        host["pos"][:num_seqs] = positions
        host["pos"][num_seqs:bucket] = 0
        host["slots"][:num_seqs] = slots
        host["slots"][num_seqs:bucket] = -1
        host["lens"][:num_seqs] = [p + 1 for p in positions]
        host["lens"][num_seqs:bucket] = 0
        tables = host["tables"]
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        # Pinned staging copies: the host arrays are reused next step while these copies may still be queued.
        for name, key in (
            ("input_ids", "ids"),
            ("position_ids", "pos"),
            ("slot_mapping", "slots"),
            ("seq_lens", "lens"),
        ):
            st[name][:bucket].copy_(torch.from_numpy(host[key][:bucket]).pin_memory(), non_blocking=True)
        st["block_tables"][:num_seqs, :width].copy_(
            torch.from_numpy(tables[:num_seqs, :width]).pin_memory(), non_blocking=True
        )
        self._fill_placeholders(st["input_ids"], dst, src, prev_tokens)
        if bucket not in self._graphs:
            self._capture(bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[0, :num_seqs].float()

    @torch.inference_mode()
    def warmup(self, num_tokens: int) -> None:
        """One dummy prefill of ``num_tokens`` tokens at start-up; nothing is written to the pool.

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
        with forward_context(ctx):
            self.model(
                input_ids=torch.zeros((1, num_tokens), dtype=torch.int64, device=self.input_device),
                position_ids=torch.arange(num_tokens, device=self.input_device).unsqueeze(0),
                attention_mask=self._no_mask,
                use_cache=False,
                logits_to_keep=torch.tensor([num_tokens - 1], device=self.output_device),
            )

    def release_graphs(self) -> None:
        """Free the captured graphs and their buffers; later decode steps run eagerly.

        Under tensor parallelism the graphs hold captured NCCL work, and ``destroy_process_group()`` hangs
        while they are alive (pytorch/pytorch#115388).
        """
        self._graphs.clear()
        self._graph_pool = None
        self._static = None
        self.use_cuda_graphs = False

    def capture_all(self) -> None:
        """Capture every decode bucket now (largest first, so smaller graphs reuse its memory pool)."""
        if self._static is None:
            self._allocate_static()
        for bucket in sorted(self.graph_sizes, reverse=True):
            if bucket not in self._graphs:
                self._capture(bucket)

    def _allocate_static(self) -> None:
        max_bs = self.graph_sizes[-1]
        dev = self.device
        self._static = {
            # Flat: a bucket's [1, bucket] view is then contiguous (torch.compile guards on strides).
            "input_ids": torch.zeros((max_bs,), dtype=torch.int64, device=dev),
            "position_ids": torch.zeros((max_bs,), dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros((max_bs,), dtype=torch.int32, device=dev),
            "block_tables": torch.zeros((max_bs, self.max_blocks_per_seq), dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "logits_idx": torch.arange(max_bs, dtype=torch.int64, device=dev),
            # Host staging (numpy views of one step's plan).
            "host": {
                "ids": np.zeros(max_bs, dtype=np.int64),
                "pos": np.zeros(max_bs, dtype=np.int64),
                "slots": np.full(max_bs, -1, dtype=np.int64),
                "lens": np.zeros(max_bs, dtype=np.int32),
                "tables": np.zeros((max_bs, self.max_blocks_per_seq), dtype=np.int32),
            },
        }

    def _capture(self, bucket: int) -> None:
        """Capture the decode forward for ``bucket`` sequences (after one eager warm-up run)."""
        st = self._static
        ctx = ForwardContext(
            slot_mapping=st["slot_mapping"][:bucket],
            block_tables=st["block_tables"][:bucket],
            seq_lens=st["seq_lens"][:bucket],
            cu_seqlens_q=st["cu_seqlens_q"][: bucket + 1],
            max_query_len=1,
            # A fixed hint: the decode kernel's split count must not change between replays.
            max_seq_len=self.max_model_len,
            batch_size=1,
            query_len=bucket,
            paged=True,
            owner=self,
            kv_caches=self.kv_caches,
        )

        def forward():
            with forward_context(ctx):
                return self._graph_forward(
                    input_ids=st["input_ids"][:bucket].unsqueeze(0),
                    position_ids=st["position_ids"][:bucket].unsqueeze(0),
                    attention_mask=self._no_mask,
                    use_cache=False,
                    logits_to_keep=st["logits_idx"][:bucket],
                ).logits

        # The live rows were just written; the warm-up may rewrite their slots with the same K/V.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()  # compiles Triton kernels, creates cuBLAS handles, outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = forward()
        self._graph_pool = graph.pool()
        self._graphs[bucket] = (graph, logits)

    def _plan(self, sched: SchedulerOutput, block_tables: list[list[int]], prev_tokens):
        """Flat inputs (on the input device) and the ForwardContext for the scheduled chunks."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        dst: list[int] = []  # flat positions whose id is a placeholder
        src: list[int] = []  # ... and the row of prev_tokens that holds it
        for chunk, table in zip(sched.chunks, block_tables, strict=True):
            seq = chunk.seq
            if seq.num_inflight:
                pos = len(seq.token_ids) - seq.num_inflight  # the oldest placeholder
                if chunk.start <= pos < chunk.end:
                    dst.append(len(ids) + pos - chunk.start)
                    src.append(seq.sample_row)
            ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end))
            q_lens.append(chunk.end - chunk.start)
            seq_lens.append(chunk.end)
            if chunk.samples:
                logits_idx.append(len(ids) - 1)
        max_blocks = max(len(t) for t in block_tables)
        tables_np = np.zeros((len(block_tables), max_blocks), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables_np[i, : len(table)] = table
        device = self.device
        ctx = ForwardContext(
            slot_mapping=to_device(slots, torch.int64, device),
            block_tables=to_device(tables_np, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            cu_seqlens_q=to_device([0, *itertools.accumulate(q_lens)], torch.int32, device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            batch_size=1,
            query_len=len(ids),
            paged=True,
            owner=self,
            kv_caches=self.kv_caches,
        )
        input_ids = to_device(ids, torch.int64, self.input_device)
        self._fill_placeholders(input_ids, dst, src, prev_tokens)
        position_ids = to_device(positions, torch.int64, self.input_device)
        logits_idx_t = to_device(logits_idx, torch.int64, self.output_device)
        return ctx, input_ids.unsqueeze(0), position_ids.unsqueeze(0), logits_idx_t
