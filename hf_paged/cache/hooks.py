"""The model hooks through which a PagedCache plans each forward.

``install_hooks`` (once per model) registers a pre- and a post-forward hook on the decoder (the module that
receives the cache and the 2D mask) and wraps the model's ``create_masks_for_generate``. Before a forward the
pre-hook either hands a planned (compiled) step's static context down as a forward kwarg (traceable, no host
code), or plans the forward eagerly and makes its ForwardContext current for the forward's layers; the
post-hook commits or drops it. The hooks find the cache among the forward's arguments (a ForwardPlanner:
PagedCache is the only one) and do nothing for any other cache.
"""

import functools

import torch

from hf_paged.cache.planning import ForwardPlanner
from hf_paged.core.attention import PLANNED_CONTEXT_KWARG
from hf_paged.core.context import ForwardContext, get_forward_context, reset_forward_context, set_forward_context

_HOOKED = "_hf_paged_hooks"


def install_hooks(model: torch.nn.Module) -> None:
    """Hook the decoder (the module that receives the cache and the 2D mask) once per model, and give the model the
    ``create_masks_for_generate`` through which generate's eager input preparation plans decode steps ahead."""
    decoder = _decoder(model)
    if getattr(decoder, _HOOKED, False):
        return
    decoder.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    decoder.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    setattr(decoder, _HOOKED, True)
    # generate calls getattr(model, "create_masks_for_generate", <transformers' function>) for compileable caches;
    # models may define their own, which every other cache keeps using.
    model.create_masks_for_generate = functools.partial(
        _create_masks_for_generate, getattr(model, "create_masks_for_generate", None)
    )


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module that receives the cache: the one holding the decoder layers (``layers``), found from the base
    model down, since some heads call it directly (OPTForCausalLM calls ``model.decoder``, never ``model``); the
    base model where no module has such a list (GPT-2's blocks are ``h``)."""
    base = getattr(model, "base_model", model)
    for module in base.modules():
        if isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            return module
    return base


def _create_masks_for_generate(model_function, **kwargs):
    """generate's mask step (eager, before each forward) for a compileable PagedCache: plan the step ahead.

    A decode step gets a 4D marker mask (transformers then builds no mask inside the forward) and is planned into
    the cache's static buffers; any other forward gets generate's 2D mask unchanged, and the decoder hook plans it.
    Other caches get the model's or transformers' own mask function.
    """
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, ForwardPlanner) or not cache.is_compileable:
        if model_function is not None:
            return model_function(**kwargs)
        from transformers.masking_utils import create_masks_for_generate

        return create_masks_for_generate(**kwargs)
    mask = kwargs.get("attention_mask")
    marker = cache._plan_ahead(tuple(kwargs["inputs_embeds"].shape[:2]), mask, kwargs.get("position_ids"))
    return mask if marker is None else marker


def _find_cache(args, kwargs) -> "ForwardPlanner | None":
    for name in ("cache", "past_key_values"):
        value = kwargs.get(name)
        if isinstance(value, ForwardPlanner):
            return value
    for value in args:
        if isinstance(value, ForwardPlanner):
            return value
    return None


def _pre_forward(module, args, kwargs):
    """Before the decoder's forward: a planned step hands its static context down (traceable, no host code);
    any other forward is planned here, eagerly."""
    cache = _find_cache(args, kwargs)
    if cache is None:
        return None
    if cache._planned:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        batch_size = cache._static.batch_size
        if input_ids is None or tuple(input_ids.shape) != (batch_size, 1):
            got = "no input_ids" if input_ids is None else f"input_ids of shape {tuple(input_ids.shape)}"
            raise ValueError(
                f"PagedCache planned a decode step of {batch_size} rows x 1 token (generate's mask step), but the "
                f"forward got {got}; a planned step needs input_ids of shape ({batch_size}, 1)"
            )
        cache._static.step_ids.copy_(input_ids.reshape(-1))  # read back by _finish_planned_step
        if not torch.compiler.is_compiling():  # generate runs this step eagerly (beam search, no compile)
            _begin_eager_planned_forward(module, cache)
            return None
        return args, {**kwargs, PLANNED_CONTEXT_KWARG: cache._static.ctx}
    return _plan_forward(module, cache, args, kwargs)


def _begin_eager_planned_forward(module, cache: ForwardPlanner) -> None:
    """A planned decode step whose forward runs eagerly: hand the layers an eager decode context over the static
    buffers (the K/V write deferred to the attention's decode launch, splits for the real longest row)."""
    static = cache._static.ctx
    ctx = ForwardContext(
        slot_mapping=static.slot_mapping,
        block_tables=static.block_tables,
        seq_lens=static.seq_lens,
        cu_seqlens_q=static.cu_seqlens_q,
        max_query_len=1,
        max_seq_len=cache._planned_max_seq_len,
        batch_size=static.batch_size,
        query_len=1,
        paged=True,
        owner=cache,
        kv_scales=cache.kv.kv_scales,
        defer_kv_write=True,
    )
    cache._planned_eager = True
    module._hf_paged_token = set_forward_context(ctx)


def _end_eager_planned_forward(module) -> None:
    token = getattr(module, "_hf_paged_token", None)
    if token is not None:
        ctx = get_forward_context()
        if ctx is not None:
            ctx.flush_pending_kv()  # a deferred K/V write no attention took (not expected): keep the cache whole
        module._hf_paged_token = None
        reset_forward_context(token)


@torch.compiler.disable  # host planning: under torch.compile a graph break (a planned step never gets here)
def _plan_forward(module, cache: ForwardPlanner, args, kwargs) -> tuple | None:
    """Plan the forward and make its context current; returns the decoder's (args, kwargs) where they change."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        shape = tuple(input_ids.shape[:2])
    elif embeds is not None:
        shape = tuple(embeds.shape[:2])
    else:
        raise ValueError("PagedCache needs input_ids or inputs_embeds in the forward call")
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    ctx = cache._begin_forward(
        input_ids, shape, mask, position_ids if isinstance(position_ids, torch.Tensor) else None
    )
    module._hf_paged_token = set_forward_context(ctx)
    keep = kwargs.get("logits_to_keep")
    if type(keep) is int and keep != 0 and ctx.paged:
        # Decoders with KV-sharing layers (Gemma 3n, Gemma 4) run those layers on the last `logits_to_keep`
        # positions only; the "paged" attention reads the forward's plan, which covers every new token: keep them
        # all (0) in the decoder. The head still keeps only the requested logits.
        return args, {**kwargs, "logits_to_keep": 0}
    return None


def _post_forward(module, args, kwargs, output):
    cache = _find_cache(args, kwargs)
    if cache is None:  # another cache (e.g. a compiled StaticCache forward of the same model): nothing to do
        return None
    if cache._planned:  # traceable: the step's bookkeeping was done when it was planned
        cache._planned = False
        cache._planned_failed = output is None  # torch passes no output when the forward raised
        if cache._planned_eager:  # never while compiling: the pre-hook sets it only outside a compile
            cache._planned_eager = False
            _end_eager_planned_forward(module)
        return None
    _end_hooked_forward(module, cache, output)
    return None


@torch.compiler.disable
def _end_hooked_forward(module, cache: ForwardPlanner, output) -> None:
    token = getattr(module, "_hf_paged_token", None)
    if token is None:
        return
    module._hf_paged_token = None
    reset_forward_context(token)
    cache._end_forward(completed=output is not None)  # torch passes no output when the forward raised
