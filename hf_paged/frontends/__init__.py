"""Front-ends: the ``hf-paged`` command line (``cli`` and its ``cli_*`` subcommand modules), the OpenAI-compatible
server (``serve``, ``openai_api``, ``api_servers``, ``serve_metrics``), the GPU benchmark suite (``bench``) and the
loading of the model a user names, the embedded default included (``models``; ``hf_paged.load_model``). They sit
above every library layer (kernels, block pool, KV pool, attention, cache, engine, serving) and nothing in the
library imports them, so the library never depends on argparse code, GGUF conversion or benchmark workloads.
"""
