"""One forward as data: which slot each new token writes, which blocks each sequence reads.

Both owners of a paged forward plan it here: the engine's model runner (one flat batch of chunks) and
PagedCache (a padded ``[batch_size, query_len]`` batch of ``generate``). CUDA-graph replay only copies a plan
into static buffers. Everything is vectorised numpy on the host; ``to_device`` sends it up without a sync.

Slot formula (the only place it is written in hf_paged; the kernels' torch reference states it too)::

    slot = block_table[position // block_size] * block_size + position % block_size      (-1: not written)
"""

from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.core.context import ForwardContext
from hf_paged.core.transfer import to_device


def slot_mapping(
    block_tables: np.ndarray,  # [num_seqs, max_blocks_per_seq], int32
    seq_idx: np.ndarray,  # [num_tokens], int: the row of block_tables of each token
    positions: np.ndarray,  # [num_tokens], int: each token's position in its sequence
    block_size: int,
) -> np.ndarray:
    """[num_tokens] int64: the pool slot of each token (see the module docstring)."""
    blocks = block_tables[seq_idx, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


@dataclass
class ForwardPlan:
    """A flat forward of ``num_seqs`` chunks: chunk ``i`` computes positions [num_computed[i], seq_lens[i])."""

    positions: np.ndarray  # [num_tokens], int64: position of each token in its sequence
    slot_mapping: np.ndarray  # [num_tokens], int64
    block_tables: np.ndarray  # [num_seqs, max_blocks], int32
    seq_lens: np.ndarray  # [num_seqs], int32: context length incl. the new tokens
    cu_seqlens_q: np.ndarray  # [num_seqs + 1], int32: offsets of each chunk's tokens
    logits_idx: np.ndarray  # [num_sampling], int64: flat index of each sampling token (the chunk's last)
    max_query_len: int
    max_seq_len: int


def plan_chunks(
    block_tables: np.ndarray,  # [num_seqs, max_blocks], int32
    num_computed: np.ndarray,  # [num_seqs], int64: tokens already in the pool
    num_new_tokens: np.ndarray,  # [num_seqs], int64: tokens this forward computes, >= 1
    sample_idx: np.ndarray,  # [num_sampling], int64: chunks whose last token samples
    block_size: int,
) -> ForwardPlan:
    """The plan of a flat batch of chunks (the engine's step): no per-token Python loop."""
    num_seqs = len(num_new_tokens)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new_tokens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_idx = np.repeat(np.arange(num_seqs), num_new_tokens)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - num_computed, num_new_tokens)
    seq_lens = num_computed + num_new_tokens
    return ForwardPlan(
        positions=positions,
        slot_mapping=slot_mapping(block_tables, seq_idx, positions, block_size),
        block_tables=block_tables,
        seq_lens=seq_lens.astype(np.int32),
        cu_seqlens_q=cu.astype(np.int32),
        logits_idx=cu[1:][sample_idx] - 1,
        max_query_len=int(num_new_tokens.max()),
        max_seq_len=int(seq_lens.max()),
    )


def shared_prefix_blocks(
    block_tables: np.ndarray,  # [num_seqs, max_blocks], int32
    seq_lens: np.ndarray,  # [num_seqs], int: context length of each row
    block_size: int,
) -> int:
    """The leading block-table entries that every row holds, with the same physical block (shared-prefix decode).

    Only each row's own blocks count (``cdiv(seq_len, block_size)`` entries; later ones may be stale), so the result
    is at most the shortest row's block count. One vectorised compare, O(num_seqs x that count). 0 for fewer than
    two rows. With two or more rows no shared block is written in the step: a row appends into a block it holds
    alone (the pool copies a shared block before it is written), so the shared blocks stay below every row's new
    token.
    """
    if len(seq_lens) < 2:
        return 0
    limit = int(-(-np.min(seq_lens) // block_size))
    if limit <= 0:
        return 0
    same = (block_tables[1:, :limit] == block_tables[0, :limit]).all(axis=0)  # [limit]
    return limit if same.all() else int(same.argmin())


def to_context(plan: ForwardPlan, device: torch.device, **kwargs) -> ForwardContext:
    """The plan's attention metadata on ``device`` (no sync); ``kwargs`` set the remaining context fields."""
    return ForwardContext(
        slot_mapping=to_device(plan.slot_mapping, torch.int64, device),
        block_tables=to_device(plan.block_tables, torch.int32, device),
        seq_lens=to_device(plan.seq_lens, torch.int32, device),
        cu_seqlens_q=to_device(plan.cu_seqlens_q, torch.int32, device),
        max_query_len=plan.max_query_len,
        max_seq_len=plan.max_seq_len,
        **kwargs,
    )


class BlockTables:
    """The runner's persistent copy of the block tables, one row per sequence, kept from the scheduler's diffs.

    ``apply`` costs O(changed entries); ``gather`` copies the rows of one step with one numpy index. The row
    indices of the last ``gather`` are kept for the next one with the same sequence ids (a decode step's are the
    step before's): they stay valid while no row is taken or freed, and ``apply`` drops them when one is.

    Args:
        max_blocks_per_seq: the table width (the longest sequence's blocks).
    """

    def __init__(self, max_blocks_per_seq: int, num_rows: int = 64):
        self.max_blocks_per_seq = max_blocks_per_seq
        self.tables = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.lens = np.zeros(num_rows, dtype=np.int64)  # blocks in each row's table
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._gathered: tuple[list[int], np.ndarray] | None = None  # (seq_ids, their rows) of the last gather

    def apply(self, updates: list[tuple[int, int, list[int] | None]]) -> None:
        """Apply (seq_id, first index, block ids) diffs in order; block ids None frees the sequence's row."""
        for seq_id, first, block_ids in updates:
            if block_ids is None:
                row = self._row_of.pop(seq_id, None)
                if row is not None:
                    self._free_rows.append(row)
                    self._gathered = None  # the row may go to another sequence, this one may get another row
                continue
            row = self._row_of.get(seq_id)
            if row is None:
                row = self._row_of[seq_id] = self._take_row()
                self._gathered = None
            end = first + len(block_ids)
            if end > self.max_blocks_per_seq:
                raise RuntimeError(f"bug in hf_paged: seq {seq_id} has {end} blocks, over {self.max_blocks_per_seq}")
            self.tables[row, first:end] = block_ids
            self.lens[row] = end

    def gather(self, seq_ids: list[int]) -> np.ndarray:
        """[num_seqs, max_blocks] int32: the tables of ``seq_ids``, as wide as the longest of them."""
        gathered = self._gathered
        if gathered is not None and gathered[0] == seq_ids:
            rows = gathered[1]
        else:
            rows = np.fromiter((self._row_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
            self._gathered = (list(seq_ids), rows)
        width = max(1, int(self.lens[rows].max())) if len(rows) else 1
        return self.tables[rows, :width]

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.tables.shape[0]
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()
