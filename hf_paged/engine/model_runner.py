"""Runs one scheduled step of any HF causal LM as a single flat forward over the paged KV pool.

Step, in order:
  1. block movements the scheduler asked for: swap out, swap in, copy-on-write copies;
  2. plan: the flat batch ``input_ids [1, T]`` / ``position_ids [1, T]`` of every scheduled chunk
     (decode tokens first, then prefill chunks), each token's slot, the block tables, the lengths, and
     the indices of the positions that sample;
  3. run: the model's forward with ``use_cache=False`` inside ``forward_context``: the "paged"
     attention function writes each layer's K/V at the slots and reads the blocks; logits are
     computed only at the sampling positions (``logits_to_keep`` with indices).
"""

import itertools

import torch

from hf_paged.context import ForwardContext, forward_context
from hf_paged.engine.scheduler import SchedulerOutput
from hf_paged.kv_pool import KVPool


class ModelRunner:
    """Owns the model's forward for the engine.

    Args:
        model: a Hugging Face causal LM set to attn_implementation="paged".
        kv: the per-layer block pools.
        block_size: tokens per block.
    """

    def __init__(self, model: torch.nn.Module, kv: KVPool, block_size: int):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.k_cache[0].device
        self.input_device = model.get_input_embeddings().weight.device
        self.kv_caches = list(zip(kv.k_cache, kv.v_cache, strict=True))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> torch.Tensor:
        """Run one step.

        Args:
            sched: the step (chunks in batch order, block movements).
            block_tables: the block table of each chunk's sequence, in chunk order.

        Returns:
            logits: [num_sampling_chunks, vocab_size] fp32, one row per chunk whose ``samples`` is True,
            in chunk order.
        """
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        self.kv.copy_blocks(sched.copies)
        ctx, input_ids, position_ids, logits_idx = self._plan(sched, block_tables)
        with forward_context(ctx):
            out = self.model(
                input_ids=input_ids.to(self.input_device, non_blocking=True),
                position_ids=position_ids.to(self.input_device, non_blocking=True),
                use_cache=False,
                logits_to_keep=logits_idx.to(self.input_device, non_blocking=True),
            )
        return out.logits[0].float()

    def _plan(self, sched: SchedulerOutput, block_tables: list[list[int]]):
        """Flat inputs and the ForwardContext for the scheduled chunks (CPU tensors, moved once)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        for chunk, table in zip(sched.chunks, block_tables, strict=True):
            seq = chunk.seq
            ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end))
            q_lens.append(chunk.end - chunk.start)
            seq_lens.append(chunk.end)
            if chunk.samples:
                logits_idx.append(len(ids) - 1)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros((len(block_tables), max_blocks), dtype=torch.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        device = self.device
        ctx = ForwardContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=tables.to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            cu_seqlens_q=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32).to(device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            batch_size=1,
            query_len=len(ids),
            paged=True,
            owner=self,
            kv_caches=self.kv_caches,
        )
        input_ids = torch.tensor([ids], dtype=torch.int64)
        position_ids = torch.tensor([positions], dtype=torch.int64)
        return ctx, input_ids, position_ids, torch.tensor(logits_idx, dtype=torch.int64)
