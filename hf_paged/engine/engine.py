"""ContinuousBatcher: an iteration-level serving engine over any Hugging Face causal LM.

    engine = ContinuousBatcher(model, tokenizer=tok)                 # pool: 0.9 of the card after a profiled step
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=256, temperature=0.7))
    for delta in engine.stream("Hello", SamplingParams(...)): print(delta.text, end="")
    rid = engine.add_request(prompt_ids, params); outs = engine.step(); engine.abort(rid)

One ``step()`` schedules, runs, samples and applies one forward (hf_paged.engine.steps lists the stages). With
async scheduling (default on CUDA) the host runs one step ahead: the outputs a ``step()`` returns are those of the
step queued by the call before.

A step is a transaction: if it raises (an error, Ctrl-C), the scheduler frees every block and requeues
every unfinished request for recompute, so the engine stays usable; ``generate()`` and ``stream()`` abort
the requests of the interrupted call. Threads: ``abort()`` is safe from any thread; every other entry point
refuses a second thread while one is inside the engine (an engine is driven by one thread; a front that
serves concurrent callers owns it on its own thread and queues their requests).
"""

import collections
import contextlib
import gc
import itertools
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch

from hf_paged.core.block_pool import BlockPool
from hf_paged.core.model_info import ModelInfo
from hf_paged.core.support import check_paged_attention_reached
from hf_paged.engine.beam_search import BeamState
from hf_paged.engine.config import EngineConfig, cuda_graphs_on, on_cuda_by_default
from hf_paged.engine.distributed import RankSync
from hf_paged.engine.inputs import InputProcessor, as_prompt_list, eos_token_ids
from hf_paged.engine.kv_manager import KVManager
from hf_paged.engine.memory import MemoryProfile, describe_kv_pool, profile_num_blocks
from hf_paged.engine.metrics import EngineMetrics, MetricsRecorder
from hf_paged.engine.model_runner import ModelRunner
from hf_paged.engine.outputs import Detokenizer, StreamCursor, StreamDelta, request_output
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.quantization import traceable_config
from hf_paged.engine.request import Request, RequestOutput
from hf_paged.engine.sampler import Sampler
from hf_paged.engine.sampling_rows import Launched, SamplingRows
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.steps import StepPipeline
from hf_paged.engine.structured import StructuredDecoding

__all__ = ["ContinuousBatcher", "EngineConfig", "EngineMetrics", "StreamDelta"]

logger = logging.getLogger(__name__)


class ContinuousBatcher(StepPipeline):
    """Continuous batching with paged KV, prefix caching, chunked prefill and preemption.

    The model is switched to ``attn_implementation="paged"``: the engine calls it as one flat batch
    ``[1, num_tokens]`` with ``use_cache=False`` and the attention function reads and writes the blocks.

    Several GPUs: a model loaded with accelerate's ``device_map`` keeps each layer's pool on that layer's
    device (one block table for all). A model loaded with ``tp_plan="auto"`` under ``torchrun`` runs one
    engine per rank: each rank's pools hold its share of the KV heads, every rank must submit the same
    requests in the same order, rank 0's sampled tokens are broadcast, and the ranks' schedules are checked
    to agree every step (hf_paged.engine.distributed).

    Args:
        model: a decoder-only Hugging Face causal LM (full or sliding-window attention layers).
        tokenizer: optional; enables string prompts, chat messages, stop strings and text outputs.
        config: an ``EngineConfig``; or pass its fields as keyword arguments (``num_blocks=``, ``block_size=``,
            ``gpu_memory_utilization=``, ``memory_fraction=``, ``max_num_batched_tokens=``, ``max_num_seqs=``,
            ``enable_prefix_caching=``, ``preemption_mode=``, ``swap_space_gb=``, ``use_cuda_graphs=``,
            ``compile_model=``, ``async_scheduling=``, ``kv_cache_dtype=``; see EngineConfig). Every setting is
            checked before anything is allocated.

    Async scheduling: a token sampled after a sequence's stop token is computed and discarded. Steps with beam
    search, penalties, ``min_tokens``, structured output or a prompt forking into ``n`` samples are processed at
    once.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None, **settings):
        if config is None:
            config = EngineConfig(**settings)
        elif settings:
            raise TypeError(f"pass either `config` or keyword settings, not both (got {sorted(settings)})")
        if not isinstance(config, EngineConfig):
            raise TypeError(f"`config` must be an EngineConfig, got {type(config).__name__}")
        info = ModelInfo.from_model(model, config.kv_cache_dtype)
        config = traceable_config(config.resolved(info.devices[0]), model, info.devices[0])  # max_num_seqs by the card
        self.config = config
        if getattr(model.config, "_attn_implementation", None) != "paged":
            import hf_paged.core.attention  # noqa: F401  (registers "paged")

            model.set_attn_implementation("paged")
        check_paged_attention_reached(model, info.num_layers)
        self.memory_profile: MemoryProfile | None = None  # how the pool was sized, when profiled
        fuse = config.fuse_projections if info.tp_size == 1 else False  # for the profiling forward's runner too
        if config.num_blocks is None and config.memory_fraction is None and info.devices[0].type == "cuda":
            self.memory_profile = profile_num_blocks(
                model, info, config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
                config.gpu_memory_utilization, cuda_graphs_on(config.use_cuda_graphs, info.devices),
                info.max_model_len or 8192, fuse_projections=fuse,
            )  # fmt: skip
            num_blocks = info.same_on_every_rank(self.memory_profile.num_blocks)  # tensor parallelism: the least
        else:
            num_blocks = info.num_blocks_for(config.num_blocks, config.block_size, config.memory_fraction or 0.5)
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        pool = BlockPool(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.kv = info.make_kv_pool(num_blocks, config.block_size)
        # e.g. "KV pool: 4096 blocks x 16 = 65536 tokens, kv_cache_dtype fp8 (float8_e4m3fn), 0.75 GiB"
        self.kv_pool_summary = describe_kv_pool(info, num_blocks, config.block_size)
        logger.info(self.kv_pool_summary)
        num_swap_slots = 0
        if config.preemption_mode == "swap":
            num_swap_slots = max(1, int(config.swap_space_gb * 2**30) // info.bytes_per_block(config.block_size))
            self.kv.allocate_swap(num_swap_slots)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.scheduler = Scheduler(
            KVManager(pool, num_swap_slots), config.max_num_batched_tokens, config.max_num_seqs,
            config.preemption_mode, self.eos_token_ids, info.max_model_len,
        )  # fmt: skip
        self.runner = ModelRunner(
            model, self.kv, config.block_size, max_num_seqs=config.max_num_seqs,
            max_model_len=info.max_model_len or 8192, max_num_batched_tokens=config.max_num_batched_tokens,
            use_cuda_graphs=config.use_cuda_graphs, compile_model=config.compile_model,
            cascade_attention=on_cuda_by_default(config.cascade_attention, info.devices),
            fuse_projections=fuse,
        )  # fmt: skip
        self._sync = RankSync(info.tp_size, self.runner.device)
        try:
            self._start_runner(config)
        except Exception as e:
            if config.compile_model is not None or self.runner.compile_mode is None:
                raise
            warnings.warn(
                f"torch.compile of the model's layers failed ({type(e).__name__}: {str(e)[:300]}); the engine runs "
                "them eagerly (slower steps). Pass compile_model=False to skip the attempt",
                stacklevel=2,
            )
            self.runner.drop_compile()
            self._start_runner(config)
        self.sampler = Sampler()
        head = model.get_output_embeddings()
        self.sample_device = head.weight.device if head is not None else self.runner.device  # where logits live
        vocab_size = head.weight.shape[0] if head is not None else info.vocab_size
        self.inputs = InputProcessor(tokenizer, vocab_size, info.max_model_len, num_blocks, config.block_size,
                                     config.max_num_seqs)  # fmt: skip
        self.detokenizer = Detokenizer(tokenizer)
        # Tensor parallelism compiles at submission: every rank must admit a structured request in the same step.
        self.structured = StructuredDecoding(tokenizer, vocab_size, self.eos_token_ids, blocking=info.tp_size > 1)
        self.requests: dict[str, Request] = {}  # unfinished, or finished and not yet returned
        self._ids = itertools.count()
        self._metrics = MetricsRecorder()
        self.async_scheduling = on_cuda_by_default(config.async_scheduling, info.devices)
        self._inflight: Launched | None = None  # the step queued last, not processed yet
        self._rows: SamplingRows | None = None  # the last step's sampling rows, while reusable (see SamplingRows)
        self._lock = threading.RLock()  # held by the thread inside the engine
        self._aborts: collections.deque[str] = collections.deque()  # abort() from any thread lands here
        self._unreported: dict[str, Request] = {}  # finished outside a step (aborts): reported by the next step
        self._unclaimed: dict[str, Request] = {}  # step()-owned requests that finished inside generate/stream

    def _start_runner(self, config: EngineConfig) -> None:
        """Warm-up forward and graph capture, at start-up (where compilation happens too)."""
        self.runner.clear_graphs()
        if self.runner.device.type == "cuda":
            self.runner.warmup(config.max_num_batched_tokens)  # kernels compiled, allocator grown: before requests
        if self.runner.use_cuda_graphs:
            if config.max_num_batched_tokens <= self.runner.mixed_sizes[-1]:
                torch.cuda.empty_cache()  # every step replays a graph: the warm-up's cached activations go back
            try:
                self.runner.capture_all()  # at start-up, as vLLM does: no capture pauses while serving
            except RuntimeError as err:
                # A model whose forward syncs with the host cannot be captured (transformers 5.17's grouped_mm MoE
                # experts copy from the host): left to the default, the engine runs it without graphs.
                if config.use_cuda_graphs or "captur" not in str(err).lower():
                    raise
                self.runner.release_graphs()
                logger.warning("%s cannot be captured in a CUDA graph (%s); the engine runs it without graphs",
                               type(self.model).__name__, str(err).splitlines()[0][:300])  # fmt: skip

    @property
    def rank_sync(self) -> RankSync:
        """This process's tensor-parallel rank and the broadcast of rank 0's tokens (one rank: a no-op); the serving
        layer reads it to decide which rank fronts the requests."""
        return self._sync

    @property
    def pool(self) -> BlockPool:
        """The block pool, for inspection (stats, invariants); only the scheduler changes it."""
        return self.scheduler.kv.pool

    # ---- submission ------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; returns its id.

        Args:
            prompt: token ids (a list of ints, a 1-D tensor or array), a string (needs a tokenizer), or chat
                messages (a list of {"role", "content"} dicts; the tokenizer's chat template is applied).
            params: sampling parameters (default ``SamplingParams()``).
            request_id: a new unique id (default: a counter).

        Raises:
            ValueError/TypeError: an empty prompt, a token id outside the vocabulary, a prompt plus
                ``max_new_tokens`` beyond the model's context or beyond the whole pool, more samples or beams
                than ``max_num_seqs``, a duplicate id; ``structured_output`` without a tokenizer or xgrammar, or
                with an invalid schema, regex or grammar. Nothing is queued then, and requests in flight are not
                affected.
        """
        with self._enter():
            params = params if params is not None else SamplingParams()
            if not isinstance(params, SamplingParams):
                raise TypeError(f"`params` must be a SamplingParams, got {type(params).__name__}")
            prompt_text, token_ids = self.inputs.tokenize(prompt)
            self.inputs.validate(token_ids, params)
            request_id = str(next(self._ids)) if request_id is None else str(request_id)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use; pick another or let the engine pick")
            grammar = self.structured.grammar_for(params)  # None without structured_output; may raise ValueError
            request = Request(request_id, token_ids, params, prompt_text)
            request.grammar = grammar
            if params.seed is not None:
                request.generator = torch.Generator(device=self.sample_device).manual_seed(params.seed)
            if params.beam_width > 1:
                request.beam_state = BeamState(params.beam_width, params.length_penalty, params.max_new_tokens)
            self.requests[request_id] = request
            if not self.structured.hold(request):  # held while its grammar compiles, else queued now
                self.scheduler.add(request)
            self._metrics.num_prompt_tokens += len(token_ids)
            return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its output ends with finish_reason "abort". Safe from any thread.

        From the thread that drives the engine (or while no step runs) it takes effect at once; while another
        thread is inside a step, at the start of the next step. The next ``step()`` reports the aborted request.
        """
        request_id = str(request_id)
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r}: not submitted, or already finished and collected")
        self._aborts.append(request_id)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_aborts()
            finally:
                self._lock.release()

    def _apply_aborts(self) -> None:
        while self._aborts:
            request = self.requests.get(self._aborts.popleft())
            if request is not None and not request.is_finished:
                self.scheduler.finish(request, "abort")
                self._unreported[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued or running, or a finished one is still to be reported by ``step()``."""
        if (self.scheduler.has_unfinished() or self._unreported or self._unclaimed or self._aborts
                or self.structured.has_waiting()):  # fmt: skip
            return True
        inflight = self._inflight
        return inflight is not None and any(not s.is_finished for s in inflight.rows)

    def get_output(self, request_id: str) -> RequestOutput:
        """What a request has produced so far (finished ones until ``step()`` or their call returned them)."""
        request = self.requests.get(str(request_id))
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}: not submitted, or already finished and collected")
        return request_output(request, self.tokenizer is not None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (e.g. between benchmark runs); blocks in use are untouched."""
        with self._enter():
            self.scheduler.reset_prefix_cache()

    def close(self) -> None:
        """Finish the step in flight and free the CUDA graphs (the engine then runs every step eagerly).

        Call it before ``torch.distributed.destroy_process_group()`` under tensor parallelism: that call hangs
        while graphs with captured NCCL collectives are alive (pytorch/pytorch#115388).
        """
        with self._enter():
            self._drain()
            self.runner.release_graphs()

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward; returns the outputs of the requests that progressed or finished in it.

        It reports the requests queued with ``add_request`` (those of a running ``generate()`` or ``stream()``
        go to that call). A finished request's output is returned once, then the engine forgets the request.
        """
        return [request_output(r, self.tokenizer is not None) for r in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """``step()`` for fronts that stream from the live requests (AsyncEngine, the data-parallel replicas):
        the same forward and bookkeeping, returning the ``Request`` objects themselves instead of a snapshot of
        each (a snapshot copies every output list: ~10 us per request per step, 2.5 ms a step at 256 requests).
        Read them on this thread, between steps."""
        with self._enter():
            touched = self._run_step()
            touched.update(self._unclaimed)
            self._unclaimed.clear()
            # Requests of a running generate()/stream() are reported to that call, not here.
            mine = [r for r in touched.values() if r.owner is None]
            for request in mine:
                if request.is_finished:
                    self.requests.pop(request.request_id, None)
            return mine

    # ---- offline and streaming ---------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:  # fmt: skip
        """Run prompts to completion (with any requests already queued); outputs in prompt order.

        Args:
            prompts: one prompt or a list (token-id lists, strings, or chat-message lists).
            params: one SamplingParams for all, or one per prompt.
            use_tqdm: show a progress bar of finished requests.

        If the call is interrupted (an exception, Ctrl-C), its requests are aborted and the engine stays usable.
        """
        with self._enter(), _frozen_heap():
            prompts = as_prompt_list(prompts)
            params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one each")
            owner = object()
            ids: list[str] = []
            try:
                for prompt, p in zip(prompts, params_list, strict=True):
                    ids.append(self.add_request(prompt, p))
                    self.requests[ids[-1]].owner = owner
                self._wait_for(ids, use_tqdm)
            except BaseException:
                for rid in ids:  # all or nothing: a bad prompt or an interrupt leaves none of this call's requests
                    self._forget(rid)
                raise
            if not self.scheduler.has_unfinished():
                self._drain()  # only discarded tokens are left in flight: leave the engine idle
            outputs = [request_output(self.requests[rid], self.tokenizer is not None) for rid in ids]
            for rid in ids:
                self._forget(rid)
            return outputs

    def _forget(self, request_id: str) -> None:
        """Drop a request a generate()/stream() call owned (aborted first if it still runs)."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, "abort")
        self._unreported.pop(request_id, None)
        self._unclaimed.pop(request_id, None)

    def _wait_for(self, ids: list[str], use_tqdm: bool) -> None:
        """Step until every request of ``ids`` is finished."""
        pending = set(ids)
        bar = _progress(len(ids), use_tqdm)
        try:
            while pending:
                touched = self._run_step()
                self._keep_unclaimed(touched)
                for request in touched.values():
                    if request.is_finished and request.request_id in pending:
                        pending.discard(request.request_id)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{self.metrics().generation_throughput:.0f} tok/s", refresh=False)
                if pending and not touched and not self.has_unfinished_requests():
                    raise RuntimeError(f"bug in hf_paged: {len(pending)} requests are neither running nor finished")
        finally:
            if bar is not None:
                bar.close()

    def _keep_unclaimed(self, touched: dict[str, Request]) -> None:
        """Finished requests added with add_request() are kept for the next step() caller."""
        for request in touched.values():
            if request.is_finished and request.owner is None:
                self._unclaimed[request.request_id] = request

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield what each step adds to one request; other requests progress too.

        Whichever call advances a step (another stream, ``step()``), every token of this request reaches this
        generator, and its last delta carries the finish reason ("abort" if it was aborted). Text comes in whole
        characters; with ``stop`` strings, the last ``max(len(s) for s in stop) - 1`` characters wait until the
        request ends (a stop string is never partly sent). Closing the generator early aborts the request.
        """
        params = params if params is not None else SamplingParams()
        if params.n != 1 or params.beam_width != 1:
            raise ValueError(f"stream() returns one sequence: needs n=1 and beam_width=1, got n={params.n}, "
                             f"beam_width={params.beam_width}; use generate() for several")  # fmt: skip
        with self._enter():
            rid = self.add_request(prompt, params)
            request = self.requests[rid]
            request.owner = owner = object()
        return self._stream(request, owner)

    def _stream(self, request: Request, owner: object) -> Iterator[StreamDelta]:
        seq = request.seqs[0]
        cursor = StreamCursor()
        try:
            while True:
                delta = cursor.next_delta(request, seq)
                if delta is not None:
                    yield delta
                if cursor.done:
                    return
                with self._enter():
                    self._keep_unclaimed(self._run_step())
        finally:
            if not request.is_finished:
                self.abort(request.request_id)
            if request.owner is owner and self._lock.acquire(blocking=False):
                try:
                    self._forget(request.request_id)
                finally:
                    self._lock.release()

    # ---- reporting ------------------------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        kv = self.scheduler.kv
        return self._metrics.snapshot(self.pool.stats, self.scheduler.num_preemptions, kv.num_swapped_out_blocks)

    # ---- threads -------------------------------------------------------------------------------

    def _enter(self):
        """The engine's lock for this thread, or a clear error while another thread is inside the engine."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "this ContinuousBatcher is in use by another thread; an engine is driven by one thread at a time "
                "(abort() is the exception). To serve concurrent callers, give the engine to one thread that "
                "drives it and hand it requests through a queue"
            )
        return _Held(self._lock)


class _Held:
    """Releases a lock acquired by ``ContinuousBatcher._enter`` at the end of a ``with`` block."""

    def __init__(self, lock):
        self._lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._lock.release()
        return False


@contextlib.contextmanager
def _frozen_heap():
    """The block's body with the objects alive at its start frozen (``gc.freeze``), unfrozen at its end.

    A collection of Python's oldest generation during ``generate()`` then walks only the objects the call made,
    not the engine's static heap (the block pool's blocks, the model, the captured graphs' Python side: hundreds of
    thousands of objects, one full collection of which costs ~0.2 s). vLLM freezes its heap once after start-up
    (vllm/utils/gc_utils.py); here the freeze lasts one call, so engines a process drops are still collected.
    Python keeps a single permanent generation, so a freeze made before the call (by the caller or a library)
    cannot be told apart from the call's: it is folded into the call's freeze and undone with it.
    """
    if not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")
