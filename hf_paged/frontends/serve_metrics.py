"""The server's Prometheus metrics (``GET /metrics``): engine gauges from the engine, request latencies from the
API server(s).

Engine side (``_EngineCollector``): running/waiting requests, KV usage, prefix hit rate, preemptions, token counts,
and per data-parallel replica its balance, from the snapshot ``engine.stats()`` took just before: the replicas' own
numbers, so they are global whichever API server answers.

Front side (``FrontObservations``): time to first token, time per output token, end-to-end latency (histograms,
vLLM's buckets) and finished requests by reason. Each API server counts its own requests into its own row of
float64 (bucket counts, sum), in shared memory when there are several (``hf-paged serve --api-server-count N``):
every row has one writer, and /metrics from any API server sums the rows, so the histograms are global too.
``hf_paged_api_server_requests{api_server}`` says how many requests each API server accepted.

Every metric carries a ``model_name`` label, as vLLM's do. With ``metric_names="vllm"`` (``hf-paged serve
--metric-names vllm``) the names take vLLM's ``vllm:`` prefix instead of ``hf_paged_``, so that dashboards made
for vLLM (``vllm:num_requests_running``, ``vllm:request_success_total``, ...) read this server as they are.
"""

import bisect
import ctypes

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from hf_paged.engine.request import RequestOutput
from hf_paged.serving.stats import ServingStats

# Buckets as vLLM's: time to first token, time per output token, end-to-end latency (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_HISTOGRAMS = (  # (name, help, bucket upper bounds); each takes len(buckets) + 1 counts (+Inf) and a sum in a row
    ("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS),
    ("time_per_output_token_seconds", "Time per output token after the first", _TPOT_BUCKETS),
    ("e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS),
)
METRIC_PREFIXES = {"hf_paged": "hf_paged_", "vllm": "vllm:"}
_TTFT, _TPOT, _E2E = range(3)
_FINISH_REASONS = ("stop", "length", "abort", "unknown")


def _offsets() -> tuple[list[int], int, int, int]:
    """Where each histogram, the finish reasons and the accepted count start in a row; and the row's width."""
    starts, width = [], 0
    for _, _, buckets in _HISTOGRAMS:
        starts.append(width)
        width += len(buckets) + 2
    reasons = width
    accepted = reasons + len(_FINISH_REASONS)
    return starts, reasons, accepted, accepted + 1


_STARTS, _REASONS, _ACCEPTED, ROW_WIDTH = _offsets()


class FrontObservations:
    """The request latencies and finish reasons API server ``front_idx`` observes, in its row of ``array``
    (``num_fronts`` rows of ``ROW_WIDTH`` float64), and the collector that sums every row for /metrics.

    Only API server ``front_idx`` writes its row; readers may see a request's histogram updated before its finish
    reason (a scrape is not atomic in Prometheus either), never a bucket count going down.
    """

    def __init__(self, array, num_fronts: int = 1, front_idx: int = 0):
        if len(array) != num_fronts * ROW_WIDTH or not 0 <= front_idx < num_fronts:
            raise ValueError(f"bug in hf_paged: {len(array)} values for {num_fronts} rows of {ROW_WIDTH}, row "
                             f"{front_idx}")  # fmt: skip
        self.array = array
        self.num_fronts = num_fronts
        self.front_idx = front_idx
        self._row = front_idx * ROW_WIDTH
        self.naming = ("hf_paged_", "")  # (metric name prefix, model_name label): set by Metrics

    @classmethod
    def local(cls) -> "FrontObservations":
        """One API server's (``hf-paged serve`` without ``--api-server-count``): a row in this process."""
        return cls((ctypes.c_double * ROW_WIDTH)())

    @classmethod
    def shared(cls, ctx, num_fronts: int) -> list["FrontObservations"]:
        """One per API server, over one shared array (made with multiprocessing context ``ctx``; it pickles into
        the API servers' processes when they start)."""
        array = ctx.RawArray("d", num_fronts * ROW_WIDTH)
        return [cls(array, num_fronts, idx) for idx in range(num_fronts)]

    def accepted(self, num_requests: int) -> None:
        """``num_requests`` requests (prompts) were handed to the engine."""
        self.array[self._row + _ACCEPTED] += num_requests

    def observe(self, output: RequestOutput | None) -> None:
        """A finished request's latencies and its finish reason (one a request, whatever its ``n``): "abort" if a
        sequence was aborted, else "length" if one was cut, else "stop"."""
        if output is None or output.metrics is None:
            self.aborted(1)
            return
        m = output.metrics
        if m.time_to_first_token is not None:
            self._observe(_TTFT, m.time_to_first_token)
        tpot = m.time_per_output_token(max(len(c.token_ids) for c in output.outputs))
        if tpot is not None:
            self._observe(_TPOT, tpot)
        if m.finished_time is not None:
            self._observe(_E2E, m.finished_time - m.arrival_time)
        reasons = {c.finish_reason for c in output.outputs}
        reason = next((r for r in ("abort", "length", "stop") if r in reasons), "unknown")
        self.array[self._row + _REASONS + _FINISH_REASONS.index(reason)] += 1

    def aborted(self, num_requests: int) -> None:
        """Requests that ended before their final output: the client left, or the stream failed."""
        self.array[self._row + _REASONS + _FINISH_REASONS.index("abort")] += num_requests

    def _observe(self, histogram: int, value: float) -> None:
        buckets = _HISTOGRAMS[histogram][2]
        start = self._row + _STARTS[histogram]
        self.array[start + bisect.bisect_left(buckets, value)] += 1  # the first bucket whose bound is >= value
        self.array[start + len(buckets) + 1] += value

    def _summed(self, offset: int) -> float:
        return sum(self.array[offset::ROW_WIDTH])

    def collect(self):
        prefix, model = self.naming
        for (name, help_, buckets), start in zip(_HISTOGRAMS, _STARTS, strict=True):
            cumulative, pairs = 0.0, []
            for idx, bound in enumerate((*buckets, float("inf"))):
                cumulative += self._summed(start + idx)
                pairs.append((floatToGoString(bound), cumulative))
            family = HistogramMetricFamily(prefix + name, help_, labels=["model_name"])
            family.add_metric([model], pairs, sum_value=self._summed(start + len(buckets) + 1))
            yield family
        finished = CounterMetricFamily(prefix + "request_success", "Finished requests by finish reason",
                                       labels=["model_name", "finished_reason"])  # fmt: skip
        for idx, reason in enumerate(_FINISH_REASONS):
            finished.add_metric([model, reason], self._summed(_REASONS + idx))
        yield finished
        accepted = CounterMetricFamily(prefix + "api_server_requests", "Requests the API server handed to the engine",
                                       labels=["model_name", "api_server"])  # fmt: skip
        for idx in range(self.num_fronts):
            accepted.add_metric([model, str(idx)], self.array[idx * ROW_WIDTH + _ACCEPTED])
        yield accepted


class _EngineCollector:
    """Engine gauges and counters for /metrics, from the snapshot the handler took just before."""

    def __init__(self):
        self.stats: ServingStats | None = None
        self.naming = ("hf_paged_", "")  # (metric name prefix, model_name label): set by Metrics

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        prefix, model = self.naming

        def family(cls, name, help_, value=None, labels=()):
            metric = cls(prefix + name, help_, labels=["model_name", *labels])
            if value is not None:
                metric.add_metric([model], value)
            return metric

        m = stats.metrics
        yield family(GaugeMetricFamily, "num_requests_running", "Requests holding KV blocks", stats.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests queued for admission", stats.num_waiting)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Share of KV blocks in use (0-1)",
                     m.num_used_blocks / m.num_blocks if m.num_blocks else 0.0)  # fmt: skip
        yield family(GaugeMetricFamily, "prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / looked "
                     "up", m.prefix_hit_rate)  # fmt: skip
        yield family(CounterMetricFamily, "num_preemptions", "Preemptions since start", m.num_preemptions)
        yield family(CounterMetricFamily, "prompt_tokens", "Prompt tokens of accepted requests", m.num_prompt_tokens)
        yield family(CounterMetricFamily, "generation_tokens", "Generated tokens", m.num_generated_tokens)
        replicas = getattr(stats, "replicas", None)  # a DataParallelEngine's: the balance between its replicas
        if replicas is not None:
            alive = family(GaugeMetricFamily, "replica_alive", "1 while the data-parallel replica serves, 0 once it "
                           "has died", labels=["replica"])  # fmt: skip
            routed = family(CounterMetricFamily, "replica_requests_routed", "Requests sent to the replica",
                            labels=["replica"])  # fmt: skip
            running = family(GaugeMetricFamily, "replica_num_requests_running", "Requests holding KV blocks",
                             labels=["replica"])  # fmt: skip
            usage = family(GaugeMetricFamily, "replica_kv_cache_usage_perc", "Share of the replica's KV blocks in "
                           "use (0-1)", labels=["replica"])  # fmt: skip
            for idx, replica in enumerate(replicas):
                label = [model, str(idx)]
                alive.add_metric(label, 0.0 if replica is None else 1.0)
                routed.add_metric(label, stats.num_routed[idx])
                if replica is not None:
                    running.add_metric(label, replica.num_running)
                    rm = replica.metrics
                    usage.add_metric(label, rm.num_used_blocks / rm.num_blocks if rm.num_blocks else 0.0)
            yield from (alive, routed, running, usage)


class Metrics:
    """The server's Prometheus registry (its own, so several apps can live in one process)."""

    def __init__(self, observations: FrontObservations | None = None, model_name: str = "",
                 metric_names: str = "hf_paged"):  # fmt: skip
        """``metric_names``: "hf_paged" (names ``hf_paged_*``) or "vllm" (vLLM's ``vllm:*``)."""
        if metric_names not in METRIC_PREFIXES:
            raise ValueError(f"`metric_names` must be one of {list(METRIC_PREFIXES)}, got {metric_names!r}")
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector()
        self.front = observations if observations is not None else FrontObservations.local()
        self.engine.naming = self.front.naming = (METRIC_PREFIXES[metric_names], model_name)
        self.registry.register(self.engine)
        self.registry.register(self.front)
