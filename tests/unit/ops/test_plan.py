"""`kvguard plan`'s searches, pure: over a small working fake of a server whose steps fit while a linear cost of
the batch stays under its headroom, and whose start-up refuses outside a utilization range."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from kvguard.ops import plan
from kvguard.ops.plan import Outcome, ServerConfig, Startup
from kvguard.ops.traffic import TrafficClass, parse_traffic
from kvguard.producers.vllm.step_memory import Batch

GiB = 1 << 30
ROW = 1 << 20  # the fake's cost of one prompt-logprob position
CONFIG = ServerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=32768, block_size=16,
                      sampling="top_p", model_runner="v1")


@dataclass
class FakeServer:
    """Fits a step while ``cost`` of it stays within ``headroom``: tokens, sampled rows, prompt-logprob rows,
    and the long-context rows (sequences x longest context) a padded attention buffer would hold."""

    headroom: int
    config: ServerConfig = CONFIG
    kv_tokens: int = 500_000
    probes: int = 0

    @property
    def startup(self) -> Startup:
        return Startup(0.9, self.config.max_num_batched_tokens, headroom_bytes=self.headroom,
                       kv_cache_tokens=self.kv_tokens)

    def peak_bytes(self, b: Batch) -> int:
        return (b.num_tokens * 1024 + b.num_seqs * 4096 + sum(b.prompt_logprobs_tokens) * ROW
                + (b.num_seqs * max(b.context_lens) * 64 if b.num_seqs > 1 else 0))

    def fits(self, b: Batch) -> bool:
        self.probes += 1
        return self.peak_bytes(b) <= self.headroom

    def slack_bytes(self, b: Batch) -> int | None:
        return self.headroom - self.peak_bytes(b) if self.fits(b) else None


@given(st.integers(1, 5000), st.integers(0, 5000), st.integers(-10, 6000))
def test_largest_fitting_finds_the_boundary_in_logarithmic_probes(lo, span, threshold):
    hi = lo + span
    calls = []
    got = plan.largest_fitting(lambda n: calls.append(n) or n <= threshold, lo, hi)
    assert got == (None if threshold < lo else min(threshold, hi))
    assert len(calls) <= span.bit_length() + 2


def test_the_prompt_logprob_limit_is_the_longest_prompt_whose_rows_fit():
    server = FakeServer(headroom=3000 * ROW)
    limit = plan.class_limit(server, TrafficClass("prompt_logprobs", 0.05, 20_000))
    # n * (ROW + 1024) + 4096 <= 3000 * ROW
    assert limit.limit == (3000 * ROW - 4096) // (ROW + 1024)
    assert not limit.unlimited and limit.declared_fits is False  # a 20,000-token prompt's first chunk is 8,192
    assert limit.peak_bytes <= limit.headroom_bytes < limit.next_peak_bytes
    assert limit.margin_bytes == limit.headroom_bytes - limit.peak_bytes
    assert plan.class_sentence(limit, 0.95) == f"prompts over {limit.limit:,} tokens with prompt_logprobs will OOM at 0.95"


def test_a_prompt_chunked_at_the_token_budget_fits_when_its_chunks_do():
    limit = plan.class_limit(FakeServer(headroom=9000 * ROW), TrafficClass("prompt_logprobs", None, 30_000))
    assert limit.unlimited and limit.limit == 8192 and limit.declared_fits is True
    assert "no prompt OOMs at 0.92 (each step computes at most 8,192 prompt positions)" in plan.class_sentence(limit, 0.92)


def test_classes_vllm_refuses_or_that_do_not_apply_say_so():
    server = FakeServer(headroom=GiB)
    assert plan.class_limit(server, TrafficClass("logprobs", None, 50)).refused == (
        "Requested sample logprobs of 50, which is greater than max allowed: 20")
    assert "needs --num-speculative-tokens" in plan.class_limit(server, TrafficClass("spec_decode")).refused


def test_long_context_steps_have_sizes_the_context_does_not_set():
    """The limit must not jump with the prompt's remainder modulo the token budget: the chunk and the seats
    are the server's, only the context grows."""
    shapes = {tuple(len(b.num_scheduled_tokens) for b in plan.REQUEST_CLASSES["long_context"].steps(
        n, CONFIG, FakeServer(GiB).startup, TrafficClass("long_context"))) for n in (9000, 12_345, 20_000, 32_767)}
    assert len(shapes) == 1
    limit = plan.class_limit(FakeServer(headroom=400 << 20), TrafficClass("long_context", None, 30_000))
    costs = [FakeServer(GiB).peak_bytes(b) for b in plan.REQUEST_CLASSES["long_context"].steps(
        limit.limit + 1, CONFIG, FakeServer(GiB).startup, TrafficClass("long_context"))]
    assert max(costs) > 400 << 20 >= limit.peak_bytes


def fake_start(low=0.50, high=0.98, total=80 * GiB, headroom_at_90=6 * GiB):
    """vLLM refuses below ``low`` (KV cache) and above ``high`` (free memory); in between the headroom falls by
    the utilization's share of the GPU."""
    def start(u, m):
        u = 0.9 if u is None else u
        if u < low:
            return Startup(u, m or 8192, refused="To serve at least one request ...", refused_for_kv=True)
        if u > high:
            return Startup(u, m or 8192, refused="Free memory on device ... is less than desired ...")
        config = CONFIG if m is None else ServerConfig(m, 256, 32768, 16, "top_p", "v1")
        return FakeServer(headroom=int(headroom_at_90 - (u - 0.9) * total), config=config)
    return start


def test_the_utilization_search_finds_where_vllm_starts_and_where_the_classes_stop_fitting():
    traffic = parse_traffic("prompt_logprobs:0.05@3000")
    low, high, fitting = plan.utilization_boundary(fake_start(), traffic)
    assert (low, high) == (0.5, 0.98)
    # 3000 rows + the prompt's tokens and one row must fit: 6 GiB - (u - 0.9) * 80 GiB >= 3000 * ROW + ...
    need = 3000 * (ROW + 1024) + 4096
    assert fake_start()(fitting, None).headroom >= need > fake_start()(round(fitting + 0.001, 3), None).headroom


def test_order_of_outcomes_as_the_utilization_rises():
    start, traffic = fake_start(), parse_traffic("prompt_logprobs@3000")
    seen = [plan.outcome(start(u / 100, None), traffic) for u in range(40, 100)]
    assert seen == sorted(seen) and set(seen) == set(Outcome)


def test_no_utilization_fits_a_class_that_never_fits():
    never = fake_start(low=0.88, headroom_at_90=GiB)  # at most 2.6 GiB of headroom where vLLM starts
    assert plan.utilization_boundary(never, parse_traffic("prompt_logprobs@8000"))[2] is None
    assert plan.utilization_boundary(fake_start(low=0.99), ())[0] is None  # vLLM never starts


def test_the_token_budget_search_stops_where_a_class_no_longer_fits():
    best = plan.batched_tokens_boundary(fake_start(), parse_traffic("prompt_logprobs"), 256, 32768)
    # at 0.9 the headroom is 6 GiB: a chunk of m positions fits while m * (ROW + 1024) + 4096 <= 6 GiB
    assert best == (6 * GiB - 4096) // (ROW + 1024) // 256 * 256


def test_what_if_gives_each_utilization_its_start_up_and_limits():
    rows = plan.what_if(fake_start(), parse_traffic("prompt_logprobs"), (0.45, 0.9, 0.95, 0.99))
    assert [r.startup.refused is None for r in rows] == [False, True, True, False]
    limits = [r.classes[0].limit for r in rows if r.classes]
    assert limits[0] > limits[1]  # more KV cache, less headroom
