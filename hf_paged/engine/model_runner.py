"""Runs one scheduled step of any HF causal LM as a single flat forward over the paged KV pool.

Step, in order:
  1. block movements the scheduler asked for: swap out, swap in, copy-on-write copies; the block-table
     diffs go into the runner's persistent tables (hf_paged.planner.BlockTables);
  2. plan (CPU, vectorised: hf_paged.planner.plan_chunks): the flat batch ``input_ids [1, T]`` /
     ``position_ids [1, T]`` of every scheduled chunk (decode tokens first, then prefill chunks), each
     token's slot, the block tables, the lengths, and the indices of the positions that sample;
  3. run: the model's forward with ``use_cache=False`` inside ``forward_context``: the "paged"
     attention function writes each layer's K/V at the slots and reads the blocks; logits are
     computed only at the sampling positions (``logits_to_keep`` with indices).

CUDA graphs: a step of decode tokens only (one token per sequence, every one sampling) replays a graph
captured for the smallest batch bucket that holds it (``GRAPH_BATCH_SIZES``; the engine captures every
bucket at start-up). Run only copies the plan into static buffers and replays: it must stay capturable
(no host sync, no shape change). Padding rows of a bucket get slot -1 (never written) and length 0
(output zeros). Prefill and mixed steps run eagerly.

Nothing here waits for the device: inputs go up through pinned staging copies (hf_paged.transfer),
and an input token that the previous step sampled but the host has not seen yet (a ``PLACEHOLDER``, async
scheduling) is copied into the input ids on the device from that step's sampled-token tensor.
"""

import numpy as np
import torch

from hf_paged.context import ForwardContext, forward_context
from hf_paged.engine.scheduler import SchedulerOutput
from hf_paged.kv_pool import KVPool
from hf_paged.planner import BlockTables, ForwardPlan, plan_chunks, to_context
from hf_paged.transfer import to_device


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
        self.tables = BlockTables(self.max_blocks_per_seq)  # kept from the scheduler's diffs
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None
        self._static = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run one step (queues the work on the device; never waits for it).

        Args:
            sched: the step, as the scheduler describes it.
            prev_sampled: [num_rows] int64 on the device, the tokens sampled by the previous step whose ids are
                not on the host yet: each ``sched.placeholders`` entry (flat index, row) reads its input id
                from ``prev_sampled[row]`` (async scheduling). None when no input is a placeholder.

        Returns:
            logits: [len(sched.sample_idx), vocab_size] fp32, row r for sequence ``sched.sample_idx[r]``; None for
            an empty step (its block movements and table diffs are still applied).
        """
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        self.kv.copy_blocks(sched.copies)
        self.tables.apply(sched.block_updates)
        if sched.is_empty:
            return None
        num_seqs = len(sched.seq_ids)
        plan = plan_chunks(
            self.tables.gather(sched.seq_ids),
            np.array(sched.num_computed, dtype=np.int64),
            np.array(sched.num_new_tokens, dtype=np.int64),
            np.array(sched.sample_idx, dtype=np.int64),
            self.block_size,
        )
        input_ids = np.array(sched.input_token_ids, dtype=np.int64)
        if (
            self.use_cuda_graphs
            and num_seqs <= self.graph_sizes[-1]
            and sched.num_batched_tokens == num_seqs
            and len(sched.sample_idx) == num_seqs
        ):
            return self._replay(plan, input_ids, sched.placeholders, prev_sampled)
        ctx = to_context(plan, self.device, batch_size=1, query_len=len(input_ids), paged=True, owner=self,
                         kv_caches=self.kv_caches)  # fmt: skip
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
        return out.logits[0].float()

    def _fill_placeholders(self, input_ids: torch.Tensor, placeholders: list[tuple[int, int]], prev_sampled) -> None:
        """input_ids[idx] = prev_sampled[row] for each (idx, row), on the device (the ids never visit the host)."""
        if not placeholders:
            return
        if prev_sampled is None:
            raise RuntimeError("bug in hf_paged: a step input is a placeholder but no previous tokens were given")
        dst, src = zip(*placeholders, strict=True)
        values = prev_sampled.index_select(0, to_device(src, torch.int64, prev_sampled.device)).to(input_ids.device)
        input_ids.index_copy_(0, to_device(dst, torch.int64, input_ids.device), values)

    # ---- CUDA graphs for decode steps --------------------------------------------------------------

    def _replay(self, plan: ForwardPlan, input_ids: np.ndarray, placeholders, prev_sampled) -> torch.Tensor:
        """Copy the decode step's plan into the static buffers and replay the bucket's graph."""
        num_seqs = len(input_ids)
        bucket = next(b for b in self.graph_sizes if b >= num_seqs)
        if self._static is None:
            self._allocate_static()
        st = self._static
        host = st["host"]
        host["input_ids"][:num_seqs] = np.maximum(input_ids, 0)  # placeholders are filled on the device below
        host["position_ids"][:num_seqs] = plan.positions
        host["slot_mapping"][:num_seqs] = plan.slot_mapping
        host["seq_lens"][:num_seqs] = plan.seq_lens
        # Padding rows: a valid id, slot -1 (never written), length 0 (output zeros).
        host["input_ids"][num_seqs:bucket] = 0
        host["position_ids"][num_seqs:bucket] = 0
        host["slot_mapping"][num_seqs:bucket] = -1
        host["seq_lens"][num_seqs:bucket] = 0
        # Pinned staging copies: the host arrays are reused next step while these copies may still be queued.
        for name in ("input_ids", "position_ids", "slot_mapping", "seq_lens"):
            st[name][:bucket].copy_(torch.from_numpy(host[name][:bucket]).pin_memory(), non_blocking=True)
        width = plan.block_tables.shape[1]
        st["block_tables"][:num_seqs, :width].copy_(
            torch.from_numpy(plan.block_tables).pin_memory(), non_blocking=True
        )
        self._fill_placeholders(st["input_ids"], placeholders, prev_sampled)
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
                "input_ids": np.zeros(max_bs, dtype=np.int64),
                "position_ids": np.zeros(max_bs, dtype=np.int64),
                "slot_mapping": np.full(max_bs, -1, dtype=np.int64),
                "seq_lens": np.zeros(max_bs, dtype=np.int32),
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
