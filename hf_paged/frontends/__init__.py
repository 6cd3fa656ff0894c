"""Front-ends: the ``hf-paged`` command line (``cli``), the GPU benchmark suite (``bench``) and the loading of the
model a user names, the embedded default included (``models``). They sit above every library layer (kernels, block
pool, KV pool, attention, cache, engine) and nothing in the library imports them, so the library never depends on
argparse code, GGUF conversion or benchmark workloads; examples, benchmarks and tests import them from here.
"""
