"""The layer both entry points share: the block pool, prefix hashing, the K/V pool, the step planner, the forward
context and the "paged" attention function. Nothing here knows PagedCache or the engine."""
