"""Whether a model's attention layers reach ``attn_implementation="paged"``: no silent fallback.

Setting an attention implementation only changes what transformers' attention interface returns; a model whose
attention modules compute attention themselves (Falcon, BLOOM, MPT and other families outside the interface)
keeps running its own code. Under the engine such a model attends over the packed batch without any past K/V and
returns wrong tokens without an error. ``check_paged_attention_reached`` runs one forward of one token and counts
the modules that call the "paged" function; a model where fewer modules call it than it has layers is refused with
the modules that did not, and what to use instead. A model that passes is not probed again.

Latent-attention (MLA) models get their paged forward first (``hf_paged.core.mla.use_paged_mla``, which refuses the
MLA variants it does not page): outside a paged forward, as in the probe, those modules run their original forward,
which calls the "paged" function, so they count as paged.
"""

import weakref

import torch

from hf_paged.core.attention import ATTN_NAME, paged_attention_forward
from hf_paged.core.mla import use_paged_mla

# Models that passed the check: the probe runs once a model, not once a cache or engine built over it.
_REACHED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def paged_attention_callers(model: torch.nn.Module) -> set[int]:
    """The ids of the modules that call the "paged" attention function in a one-token forward of ``model``.

    The forward runs without a cache and without a forward context, so the function takes its plain-attention
    path and nothing is written anywhere. A forward that fails before any module called the function (a family
    whose own mask code cannot run under "paged", as MPT's) has no callers; one that fails after is a real error.
    """
    from transformers import AttentionInterface

    device = model.get_input_embeddings().weight.device
    callers: set[int] = set()

    def counting(module, *args, **kwargs):
        callers.add(id(module))
        return paged_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(ATTN_NAME, counting)
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    except Exception:
        if callers:
            raise
    finally:
        AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    return callers


def check_paged_attention_reached(model: torch.nn.Module, num_layers: int) -> None:
    """Raise ``ValueError`` unless ``num_layers`` modules of ``model`` call attn_implementation="paged".

    Args:
        model: a transformers model whose ``config._attn_implementation`` is "paged".
        num_layers: the decoder layers the K/V pool holds, one attention call each.

    Raises:
        ValueError: the model's attention does not go through transformers' attention interface; names the
            attention modules that did not call it.
    """
    use_paged_mla(model)  # MLA modules page their latent themselves; the probe runs their original forward
    if model in _REACHED:
        return
    callers = paged_attention_callers(model)
    if len(callers) >= num_layers:
        _REACHED.add(model)
        return
    missed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")
                     and id(m) not in callers})  # fmt: skip
    where = f" ({', '.join(missed)} computes attention itself)" if missed else ""
    raise ValueError(
        f"{type(model).__name__}: {len(callers)} of its {num_layers} attention layers call "
        f"attn_implementation='paged'{where}: the model does not use transformers' attention interface, so hf_paged "
        "cannot give it paged K/V and would compute wrong tokens. Run it with model.generate and transformers' own "
        "cache (DynamicCache) instead."
    )
