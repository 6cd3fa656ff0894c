"""Throughput suite: hf_paged ContinuousBatcher vs transformers generate and its continuous batching (GPU).

Same as ``hf-paged bench``; the code lives in hf_paged/frontends/bench.py so the installed CLI can run it.
Run: python benchmarks/throughput.py --workload nano --model qwen3-0.6b [--quick] [--out benchmarks/RESULTS.md]
"""

import sys

from hf_paged.frontends.bench import main

if __name__ == "__main__":
    sys.exit(main())
