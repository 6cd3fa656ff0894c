"""Serving infrastructure over the engine: the asyncio fronts and what they share (``streaming``, ``stats``), one
engine on a thread (``async_engine``) and its tensor-parallel followers (``tensor_parallel``), and data-parallel
replica processes (``data_parallel``, ``replica_handle``, ``replica``) with their prefix-aware router
(``routing``)."""
