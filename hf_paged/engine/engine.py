"""ContinuousBatcher: an iteration-level serving engine over any Hugging Face causal LM.

    engine = ContinuousBatcher(model, tokenizer=tok)                 # pool: 0.9 of the card after a profiled step
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=256, temperature=0.7))
    for delta in engine.stream("Hello", SamplingParams(...)): print(delta.text, end="")
    rid = engine.add_request(prompt_ids, params); outs = engine.step(); engine.abort(rid)

One ``step()``, in order: the scheduler picks the tokens of the next forward and gives them slots
(hf_paged.engine.scheduler: one plain ``SchedulerOutput``); the runner computes them in one flat forward
(hf_paged.engine.model_runner); the sampler or the beam search picks the next tokens; the scheduler applies
them (``update_from_output``: stops, lengths, forks, frees); text and stop strings (hf_paged.engine.outputs).

With async scheduling (default on CUDA) the host runs one step ahead: ``step()`` schedules and queues
step N+1 on the device, then reads back and applies step N's tokens while the device computes, so the
outputs a ``step()`` returns are those of the step queued by the call before. A token of step N
reaches step N+1's input on the device, never through the host.

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
import numbers
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_paged.core.block_pool import BlockPool
from hf_paged.engine.beam_search import BeamState
from hf_paged.engine.config import EngineConfig
from hf_paged.engine.distributed import RankSync
from hf_paged.engine.inputs import InputProcessor, eos_token_ids, is_messages
from hf_paged.engine.kv_manager import KVManager
from hf_paged.engine.memory import MemoryProfile, profile_num_blocks
from hf_paged.engine.metrics import EngineMetrics, MetricsRecorder
from hf_paged.engine.model_runner import ModelRunner
from hf_paged.engine.outputs import Detokenizer, StreamCursor, StreamDelta, request_output
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request, RequestOutput
from hf_paged.engine.request import Sequence as Seq
from hf_paged.engine.sampler import RowPlan, Sampler, plan_rows
from hf_paged.engine.scheduler import Scheduler, SchedulerOutput
from hf_paged.core.model_info import ModelInfo
from hf_paged.core.transfer import to_device

# generate() feeds its prompts to the engine as it goes (``_Feeder``) instead of adding them all before the first step.
# The scheduler pulls the next prompt whenever its queue runs dry while it could admit more, so each step admits what
# it would have with every prompt queued (the schedule is the same); the other prompts are added while the device runs
# the steps already queued (with async scheduling only: synchronous steps leave the host nothing to overlap, and a
# bad prompt would be found later). Predicted: the prefix workload's 18.9 ms before its first forward on an H100 (400
# prompts of ~365 tokens checked and queued at ~29 µs each, twenty-fourth session call 3) down to ~7 ms (the ~60
# prompts its first step admits; on the CPU 14-16 -> 5 ms), ~4% of that run. Measured on an H200 (twenty-fifth
# session, benchmarks/RESULTS.md): 8.2 ms before the first forward, the same 85 steps, +1.5% end to end against an 11%
# drift between processes of one code: not resolved, so off. A first form (add a step's worth, then the rest while
# the device works) cut the wait to 0.6 ms but changed the schedule, 85 -> 137 steps on a shared host, and was
# reverted. On, a bad prompt raises when its turn comes, after earlier prompts started running (they are aborted
# then, as vLLM's LLM.generate aborts the requests it had added).
FEED_PROMPTS = False

# generate() runs with the objects alive when it starts frozen (gc.freeze; unfrozen when it returns), so that a
# collection of Python's oldest generation during the call walks only the objects the call made, not the engine's
# static heap (its block pool's blocks, the model, the captured graphs' Python side: ~410 000 objects for a tiny model
# on the CPU, where one such collection took 190 ms inside a prefix run of 400 requests; on an H100 that run takes
# ~0.29 s). vLLM freezes its heap once after start-up (vllm/utils/gc_utils.py); here the freeze lasts one call, so
# engines a process drops are still collected. Python keeps a single permanent generation, so a freeze made before
# the call (by the caller or a library: the engine tests on the card found 375 objects frozen before a test's call)
# cannot be told apart from the call's: it is folded into the call's freeze and undone with it. The first form
# (79559f4) skipped the call's freeze whenever anything was frozen, and so never froze in those tests.
FREEZE_GC_IN_GENERATE = True


@contextlib.contextmanager
def _frozen_heap():
    """The block's body with the objects alive at its start frozen (see FREEZE_GC_IN_GENERATE)."""
    if not (FREEZE_GC_IN_GENERATE and gc.isenabled()):
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


__all__ = ["ContinuousBatcher", "EngineConfig", "EngineMetrics", "StreamDelta"]


class ContinuousBatcher:
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
            ``compile_model=``, ``async_scheduling=``; see EngineConfig). Every setting is checked before anything
            is allocated.

    Async scheduling: a token sampled after a sequence's stop token is computed and discarded. Steps with beam
    search, penalties, ``min_tokens`` or a prompt forking into ``n`` samples are processed at once.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None, **settings):
        if config is None:
            config = EngineConfig(**settings)
        elif settings:
            raise TypeError(f"pass either `config` or keyword settings, not both (got {sorted(settings)})")
        if not isinstance(config, EngineConfig):
            raise TypeError(f"`config` must be an EngineConfig, got {type(config).__name__}")
        info = ModelInfo.from_model(model)
        self.config = config = config.resolved(info.devices[0])  # max_num_seqs by the card
        if getattr(model.config, "_attn_implementation", None) != "paged":
            import hf_paged.core.attention  # noqa: F401  (registers "paged")

            model.set_attn_implementation("paged")
        self.memory_profile: MemoryProfile | None = None  # how the pool was sized, when profiled
        fuse = config.fuse_projections if info.tp_size == 1 else False  # for the profiling forward's runner too
        if config.num_blocks is None and config.memory_fraction is None and info.devices[0].type == "cuda":
            self.memory_profile = profile_num_blocks(
                model, info, config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
                config.gpu_memory_utilization, _graphs_on(config, info), info.max_model_len or 8192,
                fuse_projections=fuse,
            )  # fmt: skip
            num_blocks = info._same_on_every_rank(self.memory_profile.num_blocks)  # tensor parallelism: the least
        else:
            num_blocks = info.num_blocks_for(config.num_blocks, config.block_size, config.memory_fraction or 0.5)
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        pool = BlockPool(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.kv = info.make_kv_pool(num_blocks, config.block_size)
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
            cascade_attention=_on_cuda_by_default(config.cascade_attention, info),
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
        self.requests: dict[str, Request] = {}  # unfinished, or finished and not yet returned
        self._ids = itertools.count()
        self._metrics = MetricsRecorder()
        self.async_scheduling = _on_cuda_by_default(config.async_scheduling, info)
        self._inflight: _Launched | None = None  # the step queued last, not processed yet
        self._rows: _Rows | None = None  # the last step's sampling rows, while reusable (see _Rows)
        self._lock = threading.RLock()  # held by the thread inside the engine
        self._aborts: collections.deque[str] = collections.deque()  # abort() from any thread lands here
        self._unreported: dict[str, Request] = {}  # finished outside a step (aborts): reported by the next step
        self._unclaimed: dict[str, Request] = {}  # step()-owned requests that finished inside generate/stream
        self._feeder: _Feeder | None = None  # FEED_PROMPTS: the generate() call's prompts not yet added

    def _start_runner(self, config: EngineConfig) -> None:
        """Warm-up forward and graph capture, at start-up (where compilation happens too)."""
        self.runner.clear_graphs()
        if self.runner.device.type == "cuda":
            self.runner.warmup(config.max_num_batched_tokens)  # kernels compiled, allocator grown: before requests
        if self.runner.use_cuda_graphs:
            if config.max_num_batched_tokens <= self.runner.mixed_sizes[-1]:
                torch.cuda.empty_cache()  # every step replays a graph: the warm-up's cached activations go back
            self.runner.capture_all()  # at start-up, as vLLM does: no capture pauses while serving

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
                than ``max_num_seqs``, a duplicate id. Nothing is queued then, and requests in flight are not
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
            request = Request(request_id, token_ids, params, prompt_text)
            if params.seed is not None:
                request.generator = torch.Generator(device=self.sample_device).manual_seed(params.seed)
            if params.beam_width > 1:
                request.beam_state = BeamState(params.beam_width, params.length_penalty, params.max_new_tokens)
            self.requests[request_id] = request
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
        if self.scheduler.has_unfinished() or self._unreported or self._unclaimed or self._aborts:
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

    def _drain(self) -> None:
        """Process the step in flight, if any (waits for the device)."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._process(launched, self._unreported)  # reported by the next step

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

    def _run_step(self) -> dict[str, Request]:
        """One forward, as a transaction; returns the requests that progressed, finished or were aborted.

        Async scheduling: step N+1 is scheduled and queued on the device before step N's sampled tokens are
        read back and processed, so the device never waits for the host's bookkeeping (see ``_launch``).
        """
        start = time.perf_counter()
        try:
            return self._step_once()
        except BaseException:
            self._recover()
            raise
        finally:
            self._metrics.elapsed_s += time.perf_counter() - start

    def _recover(self) -> None:
        """After a failed step: the scheduler requeues every request; those it left with no live sequence end."""
        self._inflight = None
        self._rows = None  # every sequence is requeued: nothing of the failed step's rows is kept
        self.scheduler.recover()
        for request in list(self.requests.values()):
            if request.is_finished:
                continue
            for seq in request.seqs:  # stop strings of tokens applied by the failed step
                if seq.num_detokenized < len(seq.output_token_ids):
                    self._end_on_stop_string(request, seq)
            if not request.live_seqs:
                self.scheduler.finish(request)
                self._unreported[request.request_id] = request

    def _step_once(self) -> dict[str, Request]:
        self._apply_aborts()
        # Reports accumulate in self._unreported and leave it only when the step returns: a step that fails after
        # finishing a request (say, in the step it processes after the previous one) loses no report.
        touched = self._unreported
        sched = self.scheduler.schedule()
        for request_id in sched.preempted:
            touched[request_id] = self.requests[request_id]
        prev, launched = self._inflight, None
        if not sched.is_empty:
            self._sync.check_schedule(sched)
            pool = self.pool
            if pool.num_blocks - pool.num_free_blocks > self._metrics.peak_used_blocks:
                self._metrics.observe_pool(pool.stats)
            logits = self.runner.execute(sched, prev.token_ids if prev is not None else None)
            self._metrics.num_steps += 1
            self._metrics.num_computed_tokens += sched.num_batched_tokens
            launched = self._launch(sched, logits)
        else:
            self.runner.execute(sched)  # block movements and table diffs only
            if prev is None and not touched and self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(
                    "bug in hf_paged: requests are waiting but none can be admitted into an empty pool "
                    f"({self.pool.num_free_blocks}/{self.pool.num_blocks} blocks free)"
                )
        if prev is not None:  # the previous step: its tokens are needed by now
            self._inflight = None
            if self._feeder is not None and prev.event is not None:  # generate()'s prompts, while the device works
                self._feeder.add_while_busy(prev.event)
            self._process(prev, touched)
        if launched is not None:
            if launched.deferred:
                self._inflight = launched
            else:
                self._process(launched, touched)
        self._unreported = {}
        return touched

    def _launch(self, sched: SchedulerOutput, logits: torch.Tensor) -> "_Launched":
        """Queue the sampling of one step and the copy of its tokens to the host; wait for nothing.

        Logits row ``r`` belongs to sequence ``sched.seq_ids[sched.sample_idx[r]]``; the sampler's rows are an
        explicit map into them (a prompt that forks into ``n`` samples gives its row ``n`` times; beam rows go
        to the beam search). The step is *deferred* (processed after the next step is queued) when async
        scheduling is on and every sampling row is a plain sample: no beam search, no prompt that forks into
        ``n`` samples, no penalty or ``min_tokens`` (they need the previous token on the host).
        """
        rows = self._rows
        if rows is None or rows.seq_ids != sched.seq_ids or rows.sample_idx != sched.sample_idx:
            # Sequences that finished, were aborted or preempted leave rows behind: keep the others' (no rebuild).
            rows = (rows.take(sched) if rows is not None else None) or self._sampling_rows(sched)
            self._rows = rows if rows.reusable else None
        launched = _Launched(deferred=self.async_scheduling and rows.deferrable, rows=rows.seqs,
                             requests=rows.requests, beam_rows=rows.beam_rows)  # fmt: skip
        if rows.beam_rows:  # read after this step is processed: a copy (a graph's logits are its output buffer)
            launched.logits = logits.to(torch.float32, copy=True)
        if rows.row_idx:
            identity = rows.identity and len(rows.row_idx) == logits.shape[0]
            row_logits = logits if identity else logits[to_device(rows.row_idx, torch.int64, logits.device)]
            if rows.plan is None or rows.plan.device_type != row_logits.device.type:
                rows.plan = plan_rows(rows.params, rows.generators, row_logits.device)
            out = self.sampler(row_logits, rows.params, rows.outputs, rows.prompts, rows.generators,
                               self.eos_token_ids, rows.plan)  # fmt: skip
            self._sync.broadcast(out.token_ids, out.logprobs, out.top_logprobs, out.top_token_ids)
            launched.token_ids = out.token_ids
            launched.host = [_to_host(t) for t in (out.token_ids, out.logprobs, out.top_logprobs, out.top_token_ids)]
            if out.token_ids.is_cuda:
                launched.event = torch.cuda.Event()
                launched.event.record()
            else:  # the tokens are on the host now, though a deferred step applies them after the next forward
                launched.token_time = time.monotonic()
        if launched.deferred:
            self.scheduler.add_placeholders(launched.rows)
        return launched

    def _sampling_rows(self, sched: SchedulerOutput) -> "_Rows":
        """The sampler's rows of a step (see ``_launch``), and whether the next step may reuse them."""
        get = self.scheduler.get
        seq_ids = sched.seq_ids
        pairs = [get(seq_ids[i]) for i in sched.sample_idx]
        rows = _Rows(list(seq_ids), list(sched.sample_idx))
        if all(r.forked and not r.needs_history and r.params.beam_width == 1 for _, r in pairs):
            # The common case: one row per sequence, each a plain sample of fixed inputs (reusable).
            rows.seqs = [seq for seq, _ in pairs]
            rows.requests = requests = [r for _, r in pairs]
            rows.row_idx = list(range(len(pairs)))
            rows.params = [r.params for r in requests]
            rows.outputs = [()] * len(pairs)
            rows.prompts = [r.prompt_token_ids for r in requests]
            rows.generators = [r.generator for r in requests]
            rows.identity = rows.deferrable = rows.reusable = True
            return rows
        for r, (seq, request) in enumerate(pairs):
            if request.is_beam_search:
                rows.beam_rows.setdefault(request.request_id, []).append(r)
                rows.deferrable = False
                continue
            copies = 1 if request.forked else request.params.n  # the prompt's row is sampled n times
            history = request.needs_history
            rows.deferrable = rows.deferrable and copies == 1 and not history
            for _ in range(copies):
                rows.row_idx.append(r)
                rows.params.append(request.params)
                # The output so far matters only to penalties and min_tokens; copying it costs O(length).
                rows.outputs.append(seq.output_token_ids if history else ())
                rows.prompts.append(request.prompt_token_ids)
                rows.generators.append(request.generator)
                rows.seqs.append(seq)
                rows.requests.append(request)
        rows.identity = rows.row_idx == list(range(len(pairs)))
        return rows

    def _process(self, launched: "_Launched", touched: dict[str, Request]) -> None:
        """Read a launched step's tokens back (the one wait on the device) and apply them."""
        applied = []
        if launched.host is not None:
            if launched.event is not None:
                launched.event.synchronize()
                launched.token_time = time.monotonic()
            tokens, lps, top_lps, top_ids = (t.tolist() if t is not None else None for t in launched.host)
            logprobs = None  # None: no row asked for logprobs (the sampler computes none then)
            if lps is not None:
                logprobs = []
                for row, request in enumerate(launched.requests):
                    k = request.params.logprobs
                    entry = None
                    if k is not None:
                        top = dict(zip(top_ids[row][:k], top_lps[row][:k], strict=True))
                        entry = lps[row], {tokens[row]: lps[row]} | top  # the sampled token first, then the top k
                    logprobs.append(entry)
            applied = self.scheduler.update_from_output(launched.rows, tokens, launched.deferred, launched.token_time,
                                                        logprobs)  # fmt: skip
        self._metrics.num_generated_tokens += len(applied)
        # A request can lose its last live sequence only here: one of its rows ended (a stop, the length, a stop
        # string) or its beam search did. Those are the requests to finish (every other touched one either has a
        # live sequence or was finished already: aborts, preemptions, the step processed before this one).
        ended: dict[str, Request] = {}
        detokenize = self.detokenizer.tokenizer is not None  # without one: no text to make, no stop string to find
        for request, seq in applied:
            touched[request.request_id] = request
            if detokenize:
                self._end_on_stop_string(request, seq)
            if seq.finish_reason is not None:
                ended[request.request_id] = request
        for request_id, rows in launched.beam_rows.items():
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._beam_step(request, launched.logits[to_device(rows, torch.int64, launched.logits.device)])
                touched[request_id] = request
                ended[request_id] = request
        for request in ended.values():
            if not request.is_finished and not request.live_seqs:
                self.scheduler.finish(request)

    def _end_on_stop_string(self, request: Request, seq: Seq) -> None:
        stop = self.detokenizer.update(request, seq)
        if stop is not None:
            if seq.is_finished:  # it also reached its length limit: the stop string wins
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish_seq(seq, "stop", stop)

    def _beam_step(self, request: Request, logits: torch.Tensor) -> None:
        params = request.params
        beams = request.live_seqs
        if logits.shape[0] != len(beams):
            raise RuntimeError(f"bug in hf_paged: {logits.shape[0]} logits rows for {len(beams)} live beams")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        num_out = beams[0].num_output_tokens
        masked = sorted(stop_ids | set(self.eos_token_ids)) if num_out < params.min_tokens else []
        state = request.beam_state
        saved, old_seqs = (list(state.finished), state.improvable), request.seqs
        try:
            result = state.step(logits, [b.cumulative_logprob for b in beams], [b.output_token_ids for b in beams],
                                stop_ids, masked)  # fmt: skip
            if result.done:
                request.finished_seqs = [self._hypothesis(request, hyp) for hyp in state.finished[: params.n]]
            self.scheduler.apply_beam_step(request, result)
        except BaseException:
            if request.seqs is old_seqs:  # the beams did not move: the step is redone after recovery
                state.finished, state.improvable = saved
                request.finished_seqs = []
            raise
        self._metrics.num_generated_tokens += 1  # one more output position for the request (whatever its beams)

    def _hypothesis(self, request: Request, hyp) -> Seq:
        """A finished beam hypothesis as an output sequence (not in the pool)."""
        seq = Seq(request.prompt_token_ids + hyp.token_ids, len(request.prompt_token_ids))
        seq.cumulative_logprob = hyp.sum_logprobs
        seq.finish_reason, seq.stop_reason = hyp.finish_reason, hyp.stop_reason
        seq.text = self.detokenizer.decode(request, hyp.token_ids) or ""
        return seq

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
            prompts = _as_prompt_list(prompts)
            params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one each")
            feeder = _Feeder(self, zip(prompts, params_list, strict=True), len(prompts))
            ids = feeder.ids
            try:
                if FEED_PROMPTS and self.async_scheduling:  # synchronous steps would gain nothing: all first
                    self._feeder = self.scheduler.source = feeder
                else:
                    while feeder.items:
                        feeder.pull()
                        if feeder.error is not None:
                            raise feeder.error
                self._wait_for(feeder, use_tqdm)
            except BaseException:
                for rid in ids:  # all or nothing: a bad prompt or an interrupt leaves none of this call's requests
                    self._forget(rid)
                raise
            finally:
                self._feeder = self.scheduler.source = None
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

    def _wait_for(self, feeder: "_Feeder", use_tqdm: bool) -> None:
        """Step until every prompt of ``feeder`` is added and its request finished."""
        ids = feeder.ids
        pending = set(ids)
        tracked = len(ids)  # ids[:tracked] are pending or finished; the feeder appends to ids as it adds
        bar = _progress(feeder.total, use_tqdm)
        try:
            while pending or feeder.items:
                touched = self._run_step()
                if feeder.error is not None:  # a prompt fed during the step was refused
                    raise feeder.error
                pending.update(ids[tracked:])
                tracked = len(ids)
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


class _Feeder:
    """The prompts of one ``generate()`` call, added to the engine in order (see ``FEED_PROMPTS``).

    ``pull`` adds the next one (the scheduler calls it when its queue is empty and it could admit more);
    ``add_while_busy`` adds them one by one while the device has not reached ``event`` (the end of the step whose
    tokens the engine is about to read back, the next step queued behind it). A refused prompt ends the feeding; its
    error waits in ``error`` (the step in progress is not disturbed) and ``generate()`` raises it after the step.
    """

    def __init__(self, engine: "ContinuousBatcher", items, total: int):
        self.engine = engine
        self.items = collections.deque(items)  # (prompt, params) not yet added
        self.total = total
        self.owner = object()
        self.ids: list[str] = []  # added, in prompt order
        self.error: BaseException | None = None

    def pull(self) -> None:
        prompt, params = self.items.popleft()
        try:
            request_id = self.engine.add_request(prompt, params)
        except Exception as e:
            self.error = e
            self.items.clear()
            return
        self.engine.requests[request_id].owner = self.owner
        self.ids.append(request_id)

    def add_while_busy(self, event) -> None:
        while self.items and not event.query():
            self.pull()


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are read back by ``_process``."""

    deferred: bool  # processed after the next step is queued; its rows' sequences hold placeholders
    rows: list = field(default_factory=list)  # [num_rows] Sequence of each sampled row (a forking prompt: n rows)
    requests: list = field(default_factory=list)  # [num_rows] Request of each row
    beam_rows: dict[str, list[int]] = field(default_factory=dict)  # request id -> its rows of ``logits``
    logits: torch.Tensor | None = None  # kept for beam search only
    token_ids: torch.Tensor | None = None  # [num_rows] int64 on the device: read by the next step's inputs
    host: list | None = None  # host copies of (token_ids, logprobs, top_logprobs, top_token_ids) (pinned on CUDA)
    event: torch.cuda.Event | None = None  # recorded after the copies (CUDA)
    token_time: float | None = None  # time.monotonic() when the tokens reached the host (first-token metrics)


@dataclass
class _Rows:
    """The sampling rows of a step: what ``_launch`` derives from the step's sequences and their requests.

    Reused for the next step while its ``seq_ids`` and ``sample_idx`` are the same lists (one C-level compare) and
    ``reusable``: every row is then one plain sample of a sequence whose inputs do not change between steps (no
    beams, no prompt forking into ``n`` samples, no penalties or ``min_tokens``, whose rows copy the output so
    far). Sequence ids are never reused and a sequence belongs to one request for life, so equal ids mean the same
    sequences, requests, parameters, prompts and generators: any change of the running set (an admission, a
    finish, an abort, a preemption, a fork, a beam step) changes ``seq_ids``. Rows are then kept for the sequences
    that stay (``take``: a finish, an abort, a preemption only drops rows) and rebuilt when a sequence joins.
    """

    seq_ids: list[int]  # [num_seqs] the step's sequences (the reuse key, with sample_idx)
    sample_idx: list[int]  # [num_logits] the step's sampling sequences
    row_idx: list[int] = field(default_factory=list)  # [num_rows] the logits row of each sampler row
    params: list = field(default_factory=list)  # [num_rows] SamplingParams
    outputs: list = field(default_factory=list)  # [num_rows] output so far (penalties, min_tokens), else ()
    prompts: list = field(default_factory=list)  # [num_rows] prompt token ids
    generators: list = field(default_factory=list)  # [num_rows] torch.Generator of a seeded request, else None
    seqs: list = field(default_factory=list)  # [num_rows] Sequence of each row
    requests: list = field(default_factory=list)  # [num_rows] Request of each row
    beam_rows: dict[str, list[int]] = field(default_factory=dict)  # request id -> its rows of the logits
    identity: bool = False  # row_idx is range(num_logits): the sampler takes the logits as they are
    deferrable: bool = True  # every row is a plain sample: the step may be processed after the next is queued
    reusable: bool = False  # see the class doc
    plan: RowPlan | None = None  # the sampler's checked summary of params and generators, made on first use
    row_of: dict[int, int] | None = None  # sequence id -> its row (reusable rows), made on first use by ``take``

    def take(self, sched: SchedulerOutput) -> "_Rows | None":
        """The rows of ``sched`` picked from these reusable rows, when its every sampling sequence has one here.

        A finish, an abort or a preemption only drops sequences from a step: their rows go and the others' stay
        (same sequences, so the same inputs), with no per-row lookup of requests and no new checks of parameters
        (``RowPlan.take``). None when a sequence joined (an admission, a fork): the caller rebuilds the rows.
        """
        row_of = self.row_of
        if row_of is None:
            seq_ids = self.seq_ids
            row_of = self.row_of = {seq_ids[i]: row for row, i in enumerate(self.sample_idx)}
        seq_ids = sched.seq_ids
        try:
            idx = [row_of[seq_ids[i]] for i in sched.sample_idx]
        except KeyError:
            return None
        params = [self.params[r] for r in idx]
        return _Rows(
            list(seq_ids), list(sched.sample_idx), row_idx=list(range(len(idx))), params=params,
            outputs=[()] * len(idx), prompts=[self.prompts[r] for r in idx],
            generators=[self.generators[r] for r in idx], seqs=[self.seqs[r] for r in idx],
            requests=[self.requests[r] for r in idx], identity=True, deferrable=True, reusable=True,
            plan=self.plan.take(idx, params) if self.plan is not None else None,
        )  # fmt: skip


def _on_cuda_by_default(value: bool | None, info: ModelInfo) -> bool:
    """A setting whose None means on for a model on CUDA (EngineConfig.async_scheduling, cascade_attention)."""
    return value if value is not None else info.devices[0].type == "cuda"


def _graphs_on(config: EngineConfig, info: ModelInfo) -> bool:
    """Whether the runner will replay CUDA graphs (its default: on for a model on one CUDA device)."""
    if config.use_cuda_graphs is not None:
        return config.use_cuda_graphs
    return len(set(info.devices)) == 1 and info.devices[0].type == "cuda"


def _as_prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of single prompts."""
    if prompts is None:
        raise TypeError("`prompts` must be a prompt or a list of prompts (token ids, strings or chat messages), "
                        "got None")  # fmt: skip
    if isinstance(prompts, str) or is_messages(prompts):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts] if prompts.dim() == 1 else list(prompts)
    if isinstance(prompts, np.ndarray):
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral):
        return [list(prompts)]  # one prompt of token ids
    if not isinstance(prompts, (list, tuple)):
        return [prompts]
    return list(prompts)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying ``t`` to the host without waiting (pinned memory on CUDA); read it after the event."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")
