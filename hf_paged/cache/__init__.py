"""PagedCache: a transformers ``Cache`` whose K/V live in the blocks of a preallocated pool."""

from hf_paged.cache.paged_cache import PagedCache

__all__ = ["PagedCache"]
