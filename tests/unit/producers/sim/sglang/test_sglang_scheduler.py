"""Invariants of kvguard's SGLang scheduler over random request streams (hypothesis): every page is in
exactly one place, the tree's evictable and protected sizes are what its nodes say, and the queue
drains; plus the retraction order and the new_token_ratio rules on small hand-made cases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.producers.sim.sglang.scheduler import NewTokenRatio, Scheduler, SchedulerConfig


def _pages_everywhere(s: Scheduler) -> list[int]:
    """Every page the pool, the tree and the rows hold (a page the tree holds may also be in rows)."""
    tree_pages, stack = [], [s.tree.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        tree_pages.extend(node.pages)
    in_tree = set(tree_pages)
    private = [p for r in s.requests.values() if r.holds_row
               for i, p in enumerate(r.pages) if p not in in_tree]
    return list(s.pool.free_pages) + tree_pages + private


def _check(s: Scheduler) -> None:
    pages = _pages_everywhere(s)
    assert sorted(pages) == list(range(1, s.pool.num_pages + 1)), "a page is lost or in two places"
    locked = unlocked = 0
    stack = list(s.tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        assert len(node.key) == len(node.pages) * s.page_size and node.key
        if node.lock_ref:
            locked += len(node.key)
        else:
            unlocked += len(node.key)
    assert (s.tree.protected_size(), s.tree.evictable_size()) == (locked, unlocked)
    for r in s.requests.values():
        if r.holds_row:
            assert len(r.pages) == -(-r.committed // s.page_size)


requests = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(1, 200), st.integers(0, 40)),
                    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(requests, st.sampled_from([1, 4, 16]), st.sampled_from([None, 64, 256]), st.integers(40, 190))
def test_pages_are_conserved_and_the_tree_accounts_for_them(reqs, page_size, chunk, pages):
    pool = pages * 16  # whole pages, as SGLang sizes its pool
    s = Scheduler(SchedulerConfig(max_total_num_tokens=pool, page_size=page_size, max_running_requests=8,
                                  max_prefill_tokens=1024, chunked_prefill_size=chunk, context_len=4096))
    pending = sorted(enumerate(reqs), key=lambda x: x[1][3])
    for step in range(4000):
        while pending and pending[0][1][3] <= step:
            i, (family, own, max_new, _) = pending.pop(0)
            prompt = tuple(range(family * 1000, family * 1000 + 150)) + tuple(range(10**6 + i * 1000, 10**6 + i * 1000 + own))
            s.add_request(i, prompt, max_new)
        s.step()
        _check(s)
        if not pending and not s.requests:
            break
    assert not s.requests, "the queue did not drain"


def test_retraction_takes_the_fewest_outputs_then_the_longest_prompt_and_resets_the_ratio():
    s = Scheduler(SchedulerConfig(max_total_num_tokens=3000, page_size=4, max_running_requests=32, context_len=4096,
                                  chunked_prefill_size=512))
    for i in range(60):
        s.add_request(i, tuple(range(i * 10_000, i * 10_000 + 100 + 13 * (i % 9))), 400 + 50 * (i % 5))
    victims = 0
    for _ in range(20_000):
        before = {r.rid: (len(r.output), -len(r.origin)) for r in s.running if not r.finished}
        out = s.step()
        if out.retracted:
            keys = [before[rid] for rid in out.retracted]
            kept = [k for rid, k in before.items() if rid not in out.retracted and rid not in out.aborted]
            assert all(v <= k for v in keys for k in kept), (keys, kept)  # no kept request ranks below a victim
            survivors = [r for r in s.running if not r.finished or r.rid in out.finished]
            decoded = sum(len(r.output) - (r.rid in out.decode) for r in survivors)
            assert s.ratio.current == min(1.0, (decoded + 20 * len(survivors)) /
                                          (sum(r.max_new_tokens for r in survivors) + 1))
            victims += len(out.retracted)
        if not s.requests:
            break
    assert victims >= 3 and not s.requests


def test_new_token_ratio_starts_at_0_7_and_decays_to_its_floor_in_600_steps():
    ratio = NewTokenRatio.from_conservativeness(1.0)
    assert (ratio.init, round(ratio.min, 4), round(ratio.decay, 6)) == (0.7, 0.098, 0.001003)
    for _ in range(599):
        ratio.decay_step()
    assert ratio.current > ratio.min
    ratio.decay_step()
    ratio.decay_step()
    assert ratio.current == ratio.min
    assert NewTokenRatio.from_conservativeness(2.0).init == 1.0
