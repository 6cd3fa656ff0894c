"""Greedy outputs on 2 GPUs equal 1 GPU: accelerate device_map, and tensor parallelism under torchrun.

    python benchmarks/tools/multi_gpu_check.py save /tmp/m            # a random-weight fp32 Llama (4 layers)
    python benchmarks/tools/multi_gpu_check.py device_map /tmp/m      # layers split over cuda:0 and cuda:1
    torchrun --nproc-per-node 2 benchmarks/tools/multi_gpu_check.py tp /tmp/m

Each check prints the fraction of output tokens equal to the 1-GPU run (fp32; tensor parallelism sums in
another order, so a near-tie may flip) and whether the ranks agree exactly.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_paged  # noqa: F401
from hf_paged import ContinuousBatcher, PagedCache, SamplingParams

PROMPTS = [list(range(10, 10 + n)) for n in (7, 33, 120, 260, 5, 64)]
NEW = [40, 24, 60, 17, 33, 50]


def greedy(model, **engine_kwargs):
    engine = ContinuousBatcher(model, num_blocks=512, block_size=16, max_num_batched_tokens=128, **engine_kwargs)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in NEW]
    outs = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    engine.close()  # before destroy_process_group under tensor parallelism (pytorch/pytorch#115388)
    cache = PagedCache(model, num_blocks=64, block_size=16)
    ids = torch.tensor([PROMPTS[2]], device=model.device)
    gen = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, past_key_values=cache)[0].tolist()
    return outs, gen


def agreement(a, b) -> float:
    flat_a = [t for seq in a for t in seq]
    flat_b = [t for seq in b for t in seq]
    return sum(x == y for x, y in zip(flat_a, flat_b, strict=True)) / len(flat_a)


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "save":
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(path)
        return
    import os

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    one = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged").to(f"cuda:{local}")
    ref_outs, ref_gen = greedy(one)
    if mode == "device_map":
        device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                      "model.layers.3": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}  # fmt: skip
        two = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", device_map=device_map)
        outs, gen = greedy(two)
        devices = sorted({str(k.device) for k in ContinuousBatcher(two, num_blocks=8).kv.k_cache})
        print(f"device_map: pools on {devices}; engine tokens equal to 1 GPU: {agreement(outs, ref_outs):.1%}; "
              f"PagedCache generate equal: {gen == ref_gen}")  # fmt: skip
        return
    import torch.distributed as dist

    two = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", tp_plan="auto")
    outs, gen = greedy(two)  # decode steps replay CUDA graphs with the NCCL all-reduces captured
    eager_outs, _ = greedy(two, use_cuda_graphs=False)
    gathered = [None, None]
    dist.all_gather_object(gathered, (outs, gen))
    if dist.get_rank() == 0:
        same_ranks = gathered[0] == gathered[1]
        print(f"tp={two.tp_size}: ranks agree exactly: {same_ranks}; engine tokens equal to 1 GPU: "
              f"{agreement(outs, ref_outs):.1%}; PagedCache generate equal to 1 GPU: {gen == ref_gen}; "
              f"CUDA-graph TP tokens equal to eager TP: {agreement(outs, eager_outs):.1%}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
