"""Checks of the block pool's arguments: caller mistakes raise ValueError/TypeError naming the parameter.

Pure Python (no torch).
"""

from collections.abc import Hashable, Sequence

from hf_paged.core.block import SeqBlocks


def check_token_ids(seq_id: Hashable, token_ids: Sequence[int], start: int, end: int) -> None:
    """Raise if a token in ``token_ids[start:end]`` is not a real id (< 0)."""
    window = token_ids[start:end]
    if len(window) and min(window) < 0:
        pos, bad = next((start + i, t) for i, t in enumerate(window) if t < 0)
        raise ValueError(f"`token_ids` of seq {seq_id!r} must be real token ids (>= 0), got {bad} at position {pos}")


def check_num_new_tokens(num_new_tokens: int) -> None:
    """Raise unless ``num_new_tokens`` is an int >= 0."""
    if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int):
        raise TypeError(f"`num_new_tokens` must be an int (a token count), got {type(num_new_tokens).__name__}")
    if num_new_tokens < 0:
        raise ValueError(f"`num_new_tokens` must be >= 0, got {num_new_tokens}")


def check_num_tokens_to_keep(seq_id: Hashable, seq: SeqBlocks, num_tokens: int) -> None:
    """Raise unless ``num_tokens`` is an int in [1, the sequence's token count] (what ``truncate`` may keep)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"`num_tokens` must be an int (a token count), got {type(num_tokens).__name__}")
    if not 1 <= num_tokens <= seq.num_tokens:
        raise ValueError(
            f"`num_tokens` must be in [1, {seq.num_tokens}] for seq {seq_id!r}, got {num_tokens} "
            "(free() the sequence to drop every token)"
        )
