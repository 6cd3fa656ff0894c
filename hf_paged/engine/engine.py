"""ContinuousBatcher: an iteration-level serving engine over any Hugging Face causal LM.

    engine = ContinuousBatcher(model, tokenizer=tok)                 # pool sized from free memory
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=256, temperature=0.7))
    for delta in engine.stream("Hello", SamplingParams(...)): print(delta.text, end="")
    rid = engine.add_request(prompt_ids, params); engine.step(); engine.abort(rid)

One ``step()``: the scheduler picks the tokens of the next forward (hf_paged.engine.scheduler), the
runner computes them in one flat forward (hf_paged.engine.model_runner), the sampler or the beam
search picks the next tokens, and finished sequences give their blocks back.

With async scheduling (default on CUDA) the host runs one step ahead: ``step()`` schedules and queues
step N+1 on the device, then reads back and applies step N's tokens while the device computes, so the
outputs a ``step()`` returns are those of the step queued by the call before. A token of step N
reaches step N+1's input on the device, never through the host.
"""

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from hf_paged.block_pool import BlockPool
from hf_paged.engine.beam_search import BeamState
from hf_paged.engine.distributed import RankSync
from hf_paged.engine.inputs import InputProcessor, eos_token_ids, is_messages
from hf_paged.engine.model_runner import ModelRunner
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import PLACEHOLDER, CompletionOutput, Request, RequestOutput
from hf_paged.engine.request import Sequence as Seq
from hf_paged.engine.sampler import Sampler
from hf_paged.engine.scheduler import Scheduler, SchedulerOutput
from hf_paged.transfer import to_device
from hf_paged.model_info import ModelInfo


@dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    text: str  # new text ("" without a tokenizer)
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # set on the last delta


@dataclass
class EngineMetrics:
    """Engine-wide counters since construction."""

    num_steps: int
    num_prompt_tokens: int  # prompt tokens of admitted requests
    num_computed_tokens: int  # tokens that went through the model
    num_generated_tokens: int
    elapsed_s: float  # wall time spent inside step()
    num_used_blocks: int
    peak_used_blocks: int  # high-water mark since construction
    token_state_share_at_peak: float  # token_state_share when peak_used_blocks was reached
    num_blocks: int
    token_state_share: float  # slots holding tokens / slots of used blocks
    prefix_hit_rate: float  # prompt tokens served by the prefix cache / prompt tokens looked up
    num_preemptions: int

    @property
    def generation_throughput(self) -> float:
        """Generated tokens per second of step() time."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0


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
        num_blocks: KV blocks in the pool; default: ``memory_fraction`` of free device memory.
        block_size: tokens per block (a positive multiple of 8).
        memory_fraction: share of free device memory for the pool when ``num_blocks`` is None.
        max_num_batched_tokens: token budget of one forward (chunked prefill splits longer prompts).
        max_num_seqs: most sequences in one forward; default min(256, max_num_batched_tokens).
        enable_prefix_caching: reuse full blocks across requests by content hash.
        preemption_mode: "recompute" (free and recompute later) or "swap" (copy blocks to CPU memory).
        swap_space_gb: CPU memory for swapped blocks (swap mode).
        use_cuda_graphs: replay CUDA graphs for decode steps; default: on for a model on one CUDA device (per
            rank under tensor parallelism: the NCCL all-reduces are captured too; every rank captures the
            same buckets in the same order at start-up and replays them in lock-step).
        compile_model: torch.compile the model inside the decode CUDA graphs (fuses its elementwise ops;
            compiling adds tens of seconds to start-up).
        async_scheduling: schedule and queue step N+1 before reading back step N's tokens, so the host's
            work overlaps the device's (vLLM's async scheduling). A token sampled after a sequence's
            stop token is computed and discarded. Steps with beam search, penalties, ``min_tokens`` or a
            prompt forking into ``n`` samples are processed at once. Default: on for a model on CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        memory_fraction: float = 0.5,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_space_gb: float = 4.0,
        use_cuda_graphs: bool | None = None,
        compile_model: bool = False,
        async_scheduling: bool | None = None,
    ):
        if max_num_seqs is None:
            max_num_seqs = min(256, max_num_batched_tokens) if isinstance(max_num_batched_tokens, int) else 256
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if swap_space_gb < 0:
            raise ValueError(f"`swap_space_gb` must be >= 0, got {swap_space_gb}")
        info = ModelInfo.from_model(model)
        num_blocks = info.num_blocks_for(num_blocks, block_size, memory_fraction)
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.kv = info.make_kv_pool(num_blocks, block_size)
        num_swap_slots = 0
        if preemption_mode == "swap":
            num_swap_slots = max(1, int(swap_space_gb * 2**30) // info.bytes_per_block(block_size))
            self.kv.allocate_swap(num_swap_slots)
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens, max_num_seqs, preemption_mode, num_swap_slots)
        if getattr(model.config, "_attn_implementation", None) != "paged":
            import hf_paged.attention  # noqa: F401  (registers "paged")

            model.set_attn_implementation("paged")
        self.runner = ModelRunner(
            model, self.kv, block_size, max_num_seqs=max_num_seqs,
            max_model_len=info.max_model_len or 8192, use_cuda_graphs=use_cuda_graphs, compile_model=compile_model,
        )  # fmt: skip
        self._sync = RankSync(info.tp_size, self.runner.device)
        if self.runner.device.type == "cuda":
            self.runner.warmup(max_num_batched_tokens)  # kernels compiled, allocator grown: before any request
        if self.runner.use_cuda_graphs:
            self.runner.capture_all()  # at start-up, as vLLM does: no capture pauses while serving
        self.sampler = Sampler()
        head = model.get_output_embeddings()
        self.sample_device = head.weight.device if head is not None else self.runner.device  # where logits live
        vocab_size = head.weight.shape[0] if head is not None else info.vocab_size
        self.inputs = InputProcessor(tokenizer, vocab_size, info.max_model_len, self.pool)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.requests: dict[str, Request] = {}
        self._beams: dict[str, BeamState] = {}
        self._ids = itertools.count()
        self._num_steps = self._num_prompt_tokens = self._num_computed = self._num_generated = 0
        self._elapsed = 0.0
        self._peak_used_blocks = 0
        self._peak_share = 1.0
        if async_scheduling is None:
            async_scheduling = self.runner.device.type == "cuda"
        self.async_scheduling = bool(async_scheduling)
        self._inflight: _Launched | None = None  # the step queued last, not processed yet

    # ---- submission ------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; returns its id.

        Args:
            prompt: token ids (list of ints), a string (needs a tokenizer), or chat messages
                (a list of {"role", "content"} dicts; the tokenizer's chat template is applied).
            params: sampling parameters (default ``SamplingParams()``).
            request_id: a new unique id (default: a counter).

        Raises:
            ValueError/TypeError: an empty prompt, a token id outside the vocabulary, a prompt plus
                ``max_new_tokens`` beyond the model's context or beyond the whole pool, a duplicate id.
                Nothing is queued then, and requests in flight are not affected.
        """
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
            self._beams[request_id] = BeamState(params.beam_width, params.length_penalty, params.max_new_tokens)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its output ends with finish_reason "abort"."""
        request = self.requests.get(str(request_id))
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}: not submitted, or already finished and collected")
        if request.is_finished:
            return
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        request.aborted = True
        self._finish(request)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, running, or waiting for a token of the step in flight."""
        if self.scheduler.has_unfinished():
            return True
        inflight = self._inflight
        return inflight is not None and any(not c.request.is_finished for c in inflight.targets)

    def close(self) -> None:
        """Finish the step in flight and free the CUDA graphs (the engine then runs decode steps eagerly).

        Call it before ``torch.distributed.destroy_process_group()`` under tensor parallelism: that call hangs
        while graphs with captured NCCL collectives are alive (pytorch/pytorch#115388).
        """
        self._drain()
        self.runner.release_graphs()

    def _drain(self) -> None:
        """Process the step in flight, if any (waits for the device)."""
        if self._inflight is not None:
            self._process(self._inflight, {})
            self._inflight = None

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward; returns the outputs of the requests that progressed or finished in it."""
        return [self._output(r) for r in self._run_step()]

    def _run_step(self) -> list[Request]:
        """One forward; returns the requests that progressed (building their outputs is left to callers).

        Async scheduling: step N+1 is scheduled and queued on the device before step N's sampled tokens are
        read back and processed, so the device never waits for the host's bookkeeping (see ``_launch``).
        """
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        touched: dict[str, Request] = {r.request_id: r for r in sched.preempted}
        launched = None
        if not sched.is_empty:
            self._sync.check_schedule(sched)
            tables = [self.pool.get_block_table(chunk.seq.seq_id) for chunk in sched.chunks]
            if self.pool.num_blocks - self.pool.num_free_blocks > self._peak_used_blocks:
                stats = self.pool.stats
                self._peak_used_blocks = stats.num_used_blocks
                self._peak_share = stats.num_used_slots / stats.num_allocated_slots
            prev_tokens = self._inflight.token_ids if self._inflight is not None else None
            logits = self.runner.execute(sched, tables, prev_tokens)
            self._num_steps += 1
            self._num_computed += sched.num_batched_tokens
            for chunk in sched.chunks:
                chunk.seq.num_computed = chunk.end
            launched = self._launch(sched, logits)
        elif self._inflight is None:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(
                    "bug in hf_paged: requests are waiting but none can be admitted into an empty pool "
                    f"({self.pool.num_free_blocks}/{self.pool.num_blocks} blocks free)"
                )
            return []
        if self._inflight is not None:  # the previous step: its tokens are needed by now
            self._process(self._inflight, touched)
            self._inflight = None
        if launched is not None:
            if launched.deferred:
                self._inflight = launched
            else:
                self._process(launched, touched)
        self._elapsed += time.perf_counter() - start
        return list(touched.values())

    def _launch(self, sched: SchedulerOutput, logits: torch.Tensor) -> "_Launched":
        """Queue the sampling of one step and the copy of its tokens to the host; wait for nothing.

        The step is *deferred* (processed after the next step is queued) when async scheduling is on and
        every sampling row is a plain sample: no beam search, no prompt that forks into ``n`` samples, no
        penalty or ``min_tokens`` (they need the previous token on the host). Each row's sequence then gets a
        ``PLACEHOLDER`` token, which the next step reads on the device (``Sequence.sample_row``).
        """
        rows, row_params, outputs, prompts, generators, targets = [], [], [], [], [], []
        beam_rows: dict[str, list[int]] = {}
        deferred = self.async_scheduling
        for i, chunk in enumerate(c for c in sched.chunks if c.samples):
            request = chunk.request
            if request.is_beam_search:
                beam_rows.setdefault(request.request_id, []).append(i)
                deferred = False
                continue
            copies = 1 if request.forked else request.params.n  # the prompt's row is sampled n times
            history = _needs_history(request.params)
            deferred = deferred and copies == 1 and not history
            for _ in range(copies):
                rows.append(i)
                row_params.append(request.params)
                # The output so far matters only to penalties and min_tokens; copying it costs O(length).
                outputs.append(chunk.seq.output_token_ids if history else ())
                prompts.append(request.prompt_token_ids)
                generators.append(request.generator)
                targets.append(chunk)
        launched = _Launched(targets=targets, beam_rows=beam_rows, logits=logits, deferred=deferred)
        if rows:
            row_logits = logits
            if len(rows) != logits.shape[0] or rows[-1] != len(rows) - 1:  # beam rows, or a row sampled n times
                row_logits = logits[to_device(rows, torch.int64, logits.device)]
            out = self.sampler(row_logits, row_params, outputs, prompts, generators, self.eos_token_ids)
            self._sync.broadcast(out.token_ids, out.logprobs, out.top_logprobs, out.top_token_ids)
            launched.token_ids = out.token_ids
            launched.host = [_to_host(t) for t in (out.token_ids, out.logprobs, out.top_logprobs, out.top_token_ids)]
            if out.token_ids.is_cuda:
                launched.event = torch.cuda.Event()
                launched.event.record()
        if deferred:
            max_len = self.inputs.max_len
            for row, chunk in enumerate(targets):
                seq = chunk.seq
                seq.token_ids.append(PLACEHOLDER)
                seq.num_inflight += 1
                seq.sample_row = row
                params = chunk.request.params
                seq.last_inflight = seq.num_output_tokens >= params.max_new_tokens or len(seq.token_ids) >= max_len
        else:
            launched.logits = logits if beam_rows else None
        return launched

    def _process(self, launched: "_Launched", touched: dict) -> None:
        """Read a launched step's tokens back (the one wait on the device) and apply them."""
        for chunk in launched.targets:  # a request aborted since the launch was reported then, not again
            if not chunk.request.is_finished:
                touched[chunk.request.request_id] = chunk.request
        for request_id in launched.beam_rows:
            touched[request_id] = self.requests[request_id]
        if launched.host is not None:
            if launched.event is not None:
                launched.event.synchronize()
            tokens, lps, top_lps, top_ids = (t.tolist() if t is not None else None for t in launched.host)
            targets = launched.targets
            j = 0
            while j < len(targets):
                chunk = targets[j]
                request = chunk.request
                if request.is_finished or chunk.seq.is_finished:
                    j += 1  # aborted, or ended by the previous step's token: this one is discarded
                    continue
                group = [j] if request.forked else list(range(j, j + request.params.n))
                seqs = [chunk.seq] if request.forked else self._fork(request, chunk.seq, len(group))
                for row, seq in zip(group, seqs, strict=True):
                    logprob = None
                    if lps is not None and request.params.logprobs is not None:
                        k = request.params.logprobs
                        logprob = {tokens[row]: lps[row]} | dict(zip(top_ids[row][:k], top_lps[row][:k], strict=True))
                    if launched.deferred:
                        self._resolve_placeholder(seq, tokens[row])
                    else:
                        seq.token_ids.append(tokens[row])
                    self._record_token(request, seq, tokens[row], logprob, lps[row] if lps else None)
                j += len(group)
        for request_id, idx in launched.beam_rows.items():
            request = self.requests[request_id]
            logits = launched.logits
            self._beam_step(request, logits[to_device(idx, torch.int64, logits.device)])
        for request in list(touched.values()):
            if not request.is_finished and not request.live_seqs:
                self._finish(request)

    def _resolve_placeholder(self, seq: Seq, token: int) -> None:
        """The oldest placeholder of ``seq`` becomes ``token`` (in the pool too, if it has the slot)."""
        pos = len(seq.token_ids) - seq.num_inflight
        seq.token_ids[pos] = token
        seq.num_inflight -= 1
        pool = self.pool
        if pool.has_seq(seq.seq_id) and pool.num_tokens(seq.seq_id) > pos:
            pool.set_token(seq.seq_id, pos, token)

    def _fork(self, request: Request, seq: Seq, n: int) -> list[Seq]:
        """After the prompt: seq becomes the first of n samples; the others share its blocks."""
        children = [seq]
        for _ in range(n - 1):
            child = seq.fork()
            self.pool.fork(seq.seq_id, child.seq_id)
            children.append(child)
        request.seqs = children
        request.forked = True
        return children

    def _record_token(self, request: Request, seq: Seq, token: int, logprob, token_logprob) -> None:
        """Account for ``token``, just placed in ``seq.token_ids``: logprobs, stop checks, text, finishing."""
        params = request.params
        self._num_generated += 1
        if token_logprob is not None:
            seq.cumulative_logprob += token_logprob
        if logprob is not None:
            seq.logprobs.append(logprob)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.monotonic()
        num_out = seq.num_output_tokens - seq.num_inflight  # up to and including this token
        if token in self.eos_token_ids and not params.ignore_eos and num_out > params.min_tokens - 1:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in params.stop_token_ids and num_out >= params.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", token
        if self.tokenizer is not None:
            self._detokenize(request, seq)
        if seq.finish_reason is None and (
            num_out >= params.max_new_tokens or len(seq.token_ids) - seq.num_inflight >= self.inputs.max_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.drop_inflight()  # a token sampled after this one (async scheduling) is discarded
            self.scheduler.release_seq(seq)

    def _detokenize(self, request: Request, seq: Seq) -> None:
        params = request.params
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens)
        if seq.finish_reason is None and params.stop and len(seq.output_token_ids) >= params.min_tokens:
            # Only the new tail can hold a new match.
            search_from = max(0, len(seq.text) - max(len(s) for s in params.stop))
            for stop in params.stop:
                at = text.find(stop, search_from)
                if at >= 0:
                    text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    break
        seq.text = text

    def _beam_step(self, request: Request, logits: torch.Tensor) -> None:
        params = request.params
        state = self._beams[request.request_id]
        beams = request.live_seqs
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        num_out = beams[0].num_output_tokens
        masked = sorted(stop_ids | set(self.eos_token_ids)) if num_out < params.min_tokens else []
        result = state.step(logits, [b.cumulative_logprob for b in beams], [b.output_token_ids for b in beams],
                            stop_ids, masked)  # fmt: skip
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.monotonic()
        self._num_generated += 1  # one more output position for the request (whatever its beams)
        new_seqs = []
        if not result.done:
            for parent_idx, token, score in result.new_beams:
                parent = beams[parent_idx]
                child = parent.fork()
                self.pool.fork(parent.seq_id, child.seq_id)
                child.token_ids.append(token)
                child.cumulative_logprob = score
                new_seqs.append(child)
        for beam in beams:
            self.scheduler.release_seq(beam)
        request.seqs = new_seqs
        request.forked = True
        if result.done:
            request.finished_seqs = []
            for hyp in state.finished[: params.n]:
                seq = Seq(request.prompt_token_ids + hyp.token_ids, len(request.prompt_token_ids))
                seq.cumulative_logprob = hyp.sum_logprobs
                seq.finish_reason, seq.stop_reason = hyp.finish_reason, hyp.stop_reason
                if self.tokenizer is not None:
                    seq.text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=params.skip_special_tokens)
                request.finished_seqs.append(seq)

    def _finish(self, request: Request) -> None:
        for seq in request.seqs:
            seq.drop_inflight()
        self.scheduler.finish(request)
        request.metrics.finished_time = time.monotonic()
        self._beams.pop(request.request_id, None)

    # ---- offline and streaming ---------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:  # fmt: skip
        """Run prompts to completion (with any requests already queued); outputs in prompt order.

        Args:
            prompts: one prompt or a list (token-id lists, strings, or chat-message lists).
            params: one SamplingParams for all, or one per prompt.
            use_tqdm: show a progress bar of finished requests.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if is_messages(prompts):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list, strict=True):
                ids.append(self.add_request(prompt, p))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt queues none of this call's requests
                self.abort(rid)
                self.requests.pop(rid, None)
            raise
        pending = set(ids)
        bar = _progress(len(ids), use_tqdm)
        while pending:
            for request in self._run_step():
                if request.is_finished and request.request_id in pending:
                    pending.discard(request.request_id)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{self.metrics().generation_throughput:.0f} tok/s", refresh=False)
        if bar is not None:
            bar.close()
        if not self.scheduler.has_unfinished():
            self._drain()  # only discarded tokens are left in flight: leave the engine idle
        return [self._output(self.requests.pop(rid)) for rid in ids]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield what each step adds to one request (its first sequence); other requests progress too."""
        params = params if params is not None else SamplingParams()
        if params.n != 1 or params.beam_width != 1:
            raise ValueError(f"stream() returns one sequence: needs n=1 and beam_width=1, got n={params.n}, "
                             f"beam_width={params.beam_width}; use generate() for several")  # fmt: skip
        rid = self.add_request(prompt, params)
        request = self.requests[rid]
        sent_tokens, sent_text = 0, 0
        try:
            while not request.is_finished:
                self._run_step()
                seq = request.seqs[0]
                tokens = seq.output_token_ids[sent_tokens:]
                text = seq.text[sent_text:]
                if tokens or request.is_finished:
                    sent_tokens += len(tokens)
                    sent_text += len(text)
                    yield StreamDelta(text=text, token_ids=tokens, finish_reason=seq.finish_reason)
        finally:
            if not request.is_finished:
                self.abort(rid)
            self.requests.pop(rid, None)

    # ---- reporting ------------------------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        s = self.pool.stats
        return EngineMetrics(
            num_steps=self._num_steps,
            num_prompt_tokens=s.num_prefix_query_tokens,
            num_computed_tokens=self._num_computed,
            num_generated_tokens=self._num_generated,
            elapsed_s=self._elapsed,
            num_used_blocks=s.num_used_blocks,
            peak_used_blocks=self._peak_used_blocks,
            token_state_share_at_peak=self._peak_share,
            num_blocks=s.num_blocks,
            token_state_share=s.num_used_slots / s.num_allocated_slots if s.num_allocated_slots else 1.0,
            prefix_hit_rate=s.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def _output(self, request: Request) -> RequestOutput:
        seqs = request.finished_seqs if request.is_beam_search and request.finished_seqs else request.seqs
        outputs = [
            CompletionOutput(
                index=i,
                token_ids=list(seq.output_token_ids),
                text=seq.text if self.tokenizer is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
            )
            for i, seq in enumerate(seqs)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            metrics=request.metrics,
            num_cached_tokens=getattr(request, "num_cached_tokens", 0),
        )


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are read back by ``_process``."""

    targets: list  # [num_rows] ScheduledChunk of each sampled row (a prompt sampled n times has n rows)
    beam_rows: dict[str, list[int]]  # request id -> its rows of ``logits`` (beam search)
    logits: torch.Tensor | None  # kept for beam search only
    deferred: bool  # processed after the next step is queued; its rows' sequences hold placeholders
    token_ids: torch.Tensor | None = None  # [num_rows] int64 on the device: read by the next step's inputs
    host: list | None = None  # host copies of (token_ids, logprobs, top_logprobs, top_token_ids) (pinned on CUDA)
    event: torch.cuda.Event | None = None  # recorded after the copies (CUDA)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying ``t`` to the host without waiting (pinned memory on CUDA); read it after the event."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _needs_history(p: SamplingParams) -> bool:
    return p.min_tokens > 0 or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")
