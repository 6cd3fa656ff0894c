"""Online serving benchmark for any OpenAI-compatible server, after ``vllm bench serve``'s method.

Requests arrive as a Poisson process at ``--request-rate`` (a gamma process with ``--burstiness`` != 1; ``inf``
sends them all at once), optionally capped at ``--max-concurrency`` in flight; every request streams. Per
request: TTFT (time to the first token), TPOT (time per output token after the first), ITL (the gaps between
streamed chunks) and E2EL (the whole request). Overall: request and token throughput, and goodput: requests per
second that met every SLO given with ``--goodput``. Random prompts of ``--random-input-len`` words (about one
token each; ``--prompt-ids`` sends exact token-id prompts instead, which hf_paged and vLLM accept) and
``--random-output-len`` tokens asked, both spread by ``--random-range-ratio``; fixed ``--seed``.

It talks plain OpenAI API over HTTP/1.1 with a small asyncio client of its own (one connection per request,
server-sent events parsed with ``json``): the ``openai`` client's per-chunk parsing costs ~0.1-0.2 ms, which at
saturation made the client, not the server, the bottleneck (vLLM's benchmark uses aiohttp for the same reason).
It can target ``hf-paged serve``, ``vllm serve`` or ``transformers serve --continuous-batching`` alike:

    hf-paged serve --port 8000 &
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \\
        --random-input-len 256 --random-output-len 128 --ignore-eos --goodput ttft:500 tpot:50

Output tokens are the server's count (``stream_options.include_usage``) when it reports one, else the number of
streamed chunks. ``--ignore-eos`` sends vLLM's ``ignore_eos`` extra (hf_paged and vLLM honour it), so every
request produces its asked length.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass, field

_WORDS = (
    "the of and to in is was for that on with as by at from his her it an were are which this be or has had not but "
    "their one all new more after first two also time over into most other only some city would when world made "
    "such people many before them during these school three between where about year can used game known under "
    "state while music later team life then part will each group since river season its both house film work"
).split()
_SLO_NAMES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    ok: bool = False
    error: str = ""
    num_prompt_words: int = 0
    num_output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    start: float = 0.0  # when it was sent, after the benchmark's start

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)


def make_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, prompt_ids: bool,
                  seed: int) -> list[tuple[str | list[int], int]]:  # fmt: skip
    """``num_prompts`` (prompt, max_tokens) pairs with lengths uniform in ``len * [1 - ratio, 1 + ratio]``."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"`--random-range-ratio` must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num_prompts):
        n = length(input_len)
        prompt = [rng.randrange(100, 1000) for _ in range(n)] if prompt_ids else " ".join(rng.choices(_WORDS, k=n))
        requests.append((prompt, length(output_len)))
    return requests


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``num`` requests: gamma-distributed gaps of mean 1 / request_rate (Poisson
    when burstiness = 1); all 0 with an infinite rate."""
    rng = random.Random(seed + 1)
    offsets, t = [], 0.0
    for i in range(num):
        offsets.append(t)
        if request_rate != math.inf and i < num - 1:
            t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return offsets


class _HTTP:
    """Just enough HTTP/1.1 for this benchmark: a JSON POST whose answer streams server-sent events, and a GET."""

    def __init__(self, base_url: str, api_key: str | None):
        parsed = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parsed.scheme not in ("http", "https"):
            raise ValueError(f"--base-url must be http:// or https://, got {base_url!r}")
        self.ssl = parsed.scheme == "https"
        self.host = parsed.hostname
        self.port = parsed.port or (443 if self.ssl else 80)
        self.prefix = parsed.path
        self.headers = f"Host: {parsed.netloc}\r\nConnection: close\r\n"
        if api_key:
            self.headers += f"Authorization: Bearer {api_key}\r\n"

    async def _open(self, method: str, path: str, body: bytes | None):
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None)
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.headers}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        status_line = await reader.readline()
        parts = status_line.split(None, 2)
        if len(parts) < 2:
            writer.close()
            raise ConnectionError(f"no HTTP answer from {self.host}:{self.port}")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers, reader, writer

    @staticmethod
    async def _body(headers: dict, reader: asyncio.StreamReader):
        """The response body's pieces as they arrive (chunked, sized or until the connection closes)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                yield await reader.readexactly(size)
                await reader.readexactly(2)
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while piece := await reader.read(65536):
                yield piece

    async def get_json(self, path: str):
        status, headers, reader, writer = await self._open("GET", path, None)
        try:
            body = b"".join([piece async for piece in self._body(headers, reader)])
        finally:
            writer.close()
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {body[:300]!r}")
        return json.loads(body)

    async def stream_events(self, path: str, payload: dict):
        """POST ``payload``; yield each server-sent event's JSON until ``data: [DONE]``."""
        status, headers, reader, writer = await self._open("POST", path, json.dumps(payload).encode())
        try:
            if status != 200:
                body = b"".join([piece async for piece in self._body(headers, reader)])
                raise RuntimeError(f"POST {path}: HTTP {status}: {body[:300]!r}")
            buffer = b""
            async for piece in self._body(headers, reader):
                buffer += piece
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        yield json.loads(data)
        finally:
            writer.close()


async def _one(client: _HTTP, endpoint: str, model: str, prompt, max_tokens: int, ignore_eos: bool,
               timeout: float) -> RequestResult:  # fmt: skip
    result = RequestResult(num_prompt_words=len(prompt) if isinstance(prompt, list) else len(prompt.split()))
    payload = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
                   stream_options={"include_usage": True})  # fmt: skip
    if ignore_eos:
        payload["ignore_eos"] = True
    if endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        payload["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        payload["prompt"] = prompt
        path = "/v1/completions"
    start = time.perf_counter()
    last = None
    chunks, usage_tokens = 0, None
    try:
        async with asyncio.timeout(timeout):
            async for chunk in client.stream_events(path, payload):
                if "error" in chunk and "choices" not in chunk:
                    raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                content = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                if content:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.e2el = time.perf_counter() - start
        result.num_output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.ok = last is not None
        if not result.ok:
            result.error = "no content streamed"
    except Exception as err:  # counted as failed, as vllm bench serve does
        result.error = f"{type(err).__name__}: {err}"
    return result


def summarize(results: list[RequestResult], duration_s: float, percentiles: list[float],
              slos_ms: dict[str, float]) -> dict:  # fmt: skip
    """The benchmark's metrics (times in ms, throughputs per second), as ``vllm bench serve`` reports them."""
    ok = [r for r in results if r.ok]
    out = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_words": sum(r.num_prompt_words for r in ok),
        "total_output_tokens": sum(r.num_output_tokens for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": sum(r.num_output_tokens for r in ok) / duration_s if duration_s else 0.0,
    }
    series = {
        "ttft_ms": [r.ttft * 1e3 for r in ok],
        "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl_ms": [gap * 1e3 for r in ok for gap in r.itl],
        "e2el_ms": [r.e2el * 1e3 for r in ok],
    }
    for name, values in series.items():
        out[f"mean_{name}"] = statistics.fmean(values) if values else None
        out[f"median_{name}"] = statistics.median(values) if values else None
        out[f"std_{name}"] = statistics.pstdev(values) if values else None
        for p in percentiles:
            out[f"p{p:g}_{name}"] = _percentile(values, p)
    if slos_ms:
        good = 0
        for r in ok:
            measured = {"ttft_ms": r.ttft * 1e3, "tpot_ms": (r.tpot or 0.0) * 1e3, "e2el_ms": r.e2el * 1e3}
            good += all(measured[key] <= limit for key, limit in slos_ms.items())
        out["goodput"] = good / duration_s if duration_s else 0.0
    return out


def _percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft_ms": 500.0, "tpot_ms": 50.0}``."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in _SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {sorted(_SLO_NAMES)}, got {item!r}")
        try:
            slos[_SLO_NAMES[name]] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the limit must be a number of milliseconds") from None
    return slos


async def _run_share(args: argparse.Namespace, model: str, requests: list, offsets: list[float],
                     indices: list[int], t0: float, concurrency: int) -> list[tuple[int, RequestResult]]:  # fmt: skip
    """Send requests ``indices``, each at ``t0 + offsets[i]`` (perf_counter time, shared by the processes of one
    machine: CLOCK_MONOTONIC), at most ``concurrency`` in flight; their results by index."""
    client = _HTTP(args.base_url, args.api_key)
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[int, RequestResult]:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        async with limit:
            prompt, max_tokens = requests[i]
            sent = time.perf_counter()
            result = await _one(client, args.endpoint, model, prompt, max_tokens, args.ignore_eos, args.timeout)
            result.start = sent - t0
            return i, result

    return list(await asyncio.gather(*(one(i) for i in indices)))


def _client_process(args, model, requests, offsets, indices, concurrency, start, results) -> None:
    """One of ``--client-processes``: says it is ready, waits for the common start time on ``start``, sends its
    share of the requests; results (index, fields) into ``results``."""
    try:
        results.put("ready")
        t0 = start.get()
        done = asyncio.run(_run_share(args, model, requests, offsets, indices, t0, concurrency))
        results.put([(i, dataclasses.astuple(r)) for i, r in done])
    except BaseException as err:  # never leave the parent waiting
        results.put(err if isinstance(err, Exception) else RuntimeError(repr(err)))


def _receive(queue, procs: list, timeout_s: float = 120.0):
    """The next message of the client processes; raises if one died without a word or nothing came in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return queue.get(timeout=1.0)
        except Exception:  # queue.Empty
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a client process exited with {dead[0].exitcode} (if it could not import this "
                                   "module: run it as a script or import it by name)") from None  # fmt: skip
            if time.monotonic() > deadline:
                raise TimeoutError(f"no word from the client processes in {timeout_s:.0f} s") from None


async def benchmark(args: argparse.Namespace) -> dict:
    """Run the benchmark; with ``--client-processes P > 1`` the requests are dealt round-robin to P processes (each
    its own event loop) sharing one arrival schedule, so the client's own parsing is not the bottleneck."""
    model = args.model or (await _HTTP(args.base_url, args.api_key).get_json("/v1/models"))["data"][0]["id"]
    requests = make_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                             args.prompt_ids, args.seed)  # fmt: skip
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    concurrency = args.max_concurrency or len(requests)
    processes = max(1, min(args.client_processes, len(requests)))
    if processes == 1:
        t0 = time.perf_counter()
        done = await _run_share(args, model, requests, offsets, list(range(len(requests))), t0, concurrency)
        results = [r for _, r in sorted(done, key=lambda x: x[0])]
    else:
        ctx = multiprocessing.get_context("spawn")
        queue, start = ctx.Queue(), ctx.Queue()
        share = -(-concurrency // processes)
        procs = [ctx.Process(target=_client_process, daemon=True,
                             args=(args, model, requests, offsets, list(range(k, len(requests), processes)), share,
                                   start, queue)) for k in range(processes)]  # fmt: skip
        for proc in procs:  # spawned: each imports the main module again (seconds, with torch) before it is ready
            proc.start()
        ready = [await asyncio.to_thread(_receive, queue, procs) for _ in procs]
        if any(r != "ready" for r in ready):
            raise RuntimeError(f"a client process failed to start: {[r for r in ready if r != 'ready'][0]!r}")
        t0 = time.perf_counter() + 0.1
        for _ in procs:
            start.put(t0)
        parts = [await asyncio.to_thread(_receive, queue, procs, args.timeout * len(requests)) for _ in procs]
        for proc in procs:
            proc.join()
        errors = [p for p in parts if isinstance(p, BaseException)]
        if errors:
            raise RuntimeError(f"a client process failed: {errors[0]!r}") from errors[0]
        by_index = {i: RequestResult(*fields) for part in parts for i, fields in part}
        results = [by_index[i] for i in range(len(requests))]
    # From the first send to the last answer (perf_counter is CLOCK_MONOTONIC: one clock for the machine's processes).
    ok = [r for r in results if r.ok]
    duration = max(r.start + r.e2el for r in ok) - min(r.start for r in ok) if ok else 0.0
    summary = summarize(results, duration, args.percentiles, parse_goodput(args.goodput))
    rate = None if args.request_rate == math.inf else args.request_rate  # None = all at once (JSON has no inf)
    summary.update(model=model, endpoint=args.endpoint, num_prompts=args.num_prompts, request_rate=rate,
                   burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                   client_processes=processes)  # fmt: skip
    return summary


def _report(s: dict, percentiles: list[float]) -> str:
    lines = [
        f"{'Successful requests:':<40}{s['completed']}",
        f"{'Failed requests:':<40}{s['failed']}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:.2f}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:.2f}",
    ]
    if "goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<40}{s['goodput']:.2f}")
    for name, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                        ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):  # fmt: skip
        lines.append(f"{'-' * 10} {title} {'-' * 10}")
        for key in ["mean", "median", *(f"p{p:g}" for p in percentiles)]:
            value = s[f"{key}_{name}"]
            lines.append(f"{key.capitalize() + ' (ms):':<40}{'n/a' if value is None else f'{value:.2f}'}")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--model", help="default: the first model /v1/models lists")
    parser.add_argument("--api-key", help="Bearer token, if the server wants one")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=256, help="prompt length (words or token ids)")
    parser.add_argument("--random-output-len", type=int, default=128, help="max_tokens asked")
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths spread: len * [1-r, 1+r]")
    parser.add_argument("--prompt-ids", action="store_true", help="send token-id prompts of exact lengths")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (hf_paged, vLLM)")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS", help="SLOs: ttft, tpot, e2el in ms")
    parser.add_argument("--percentiles", type=lambda s: [float(p) for p in s.split(",")], default=[50.0, 90.0, 99.0],
                        help="comma-separated, default 50,90,99")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes sharing the requests (one asyncio client parses ~20-30k SSE events/s)",
    )
    parser.add_argument("--result-file", help="also write the metrics as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_goodput(args.goodput)
        if args.client_processes < 1:
            raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
        if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
            raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
        if args.request_rate <= 0 or args.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be > 0")
        if not 0 <= args.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    except ValueError as err:
        print(f"serve benchmark: error: {err}", file=sys.stderr)
        return 2
    summary = asyncio.run(benchmark(args))
    print(_report(summary, args.percentiles))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
