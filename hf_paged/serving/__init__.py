"""Serving infrastructure over the engine: the asyncio front (AsyncEngine), data-parallel replicas and their router,
and the tensor-parallel followers."""
