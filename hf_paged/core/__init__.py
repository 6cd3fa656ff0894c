"""The layer both entry points share: the block pool (``block_pool``, built from ``block``, ``block_allocator``,
``free_list``, ``prefix_index``, ``prefix_hash``, ``pool_args`` and ``pool_stats``, all pure Python), the K/V
pool, the step planner, the forward context and the "paged" attention function. Nothing here knows PagedCache or
the engine."""
