"""ContinuousBatcher: request, scheduler, model runner, sampler, beam search, outputs (see engine.py)."""
