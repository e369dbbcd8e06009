from __future__ import annotations

import random

import pytest

from photon.engine import kv_cache
from photon.engine.kv_cache import KVCacheManager, PrefixMatch

BS = 4


def make(num_blocks: int = 9, enabled: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=enabled)


def run_request(m: KVCacheManager, rid: str, tokens: list[int], cache: bool = True) -> PrefixMatch:
    """Match, allocate for the whole prompt, publish its full blocks."""
    match = m.match_prefix(tokens)
    assert m.allocate(rid, len(tokens), match)
    if cache:
        m.cache_blocks(rid, tokens, len(tokens))
    m.check_invariants()
    return match


def test_initial_state() -> None:
    m = make()
    assert m.num_free_blocks == 8
    assert m.num_used_blocks == 0
    assert m.usage == 0.0
    assert m.num_blocks_needed(0) == 0
    assert m.num_blocks_needed(1) == 1
    assert m.num_blocks_needed(4) == 1
    assert m.num_blocks_needed(5) == 2
    m.check_invariants()


def test_allocation_grows_and_never_shrinks() -> None:
    m = make()
    assert m.allocate("a", 3)
    assert m.block_ids("a") == [1]
    assert m.allocate("a", 9)
    assert m.block_ids("a") == [1, 2, 3]
    assert m.allocate("a", 2)  # smaller request: no-op
    assert m.block_ids("a") == [1, 2, 3]
    assert m.num_used_blocks == 3
    assert m.num_free_blocks == 5
    assert m.usage == pytest.approx(3 / 8)
    assert all(m.refcount(b) == 1 for b in (1, 2, 3))
    assert m.refcount(0) == 0
    m.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    m = make()
    assert m.allocate("a", 6 * BS)
    assert not m.allocate("b", 3 * BS)  # only 2 free
    assert m.block_ids("b") == []
    assert not m.allocate("a", 9 * BS)
    assert len(m.block_ids("a")) == 6
    assert m.num_free_blocks == 2
    assert m.allocate("b", 2 * BS)
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_block_ids_returns_copy() -> None:
    m = make()
    m.allocate("a", BS)
    m.block_ids("a").append(99)
    assert m.block_ids("a") == [1]


def test_free_returns_blocks_and_zeroes_refcounts() -> None:
    m = make()
    m.allocate("a", 3 * BS)
    m.free("a")
    assert m.num_free_blocks == 8
    assert m.num_used_blocks == 0
    assert all(m.refcount(b) == 0 for b in range(9))
    assert m.block_ids("a") == []
    m.free("a")  # unknown id: no-op
    m.free("never-seen")
    m.check_invariants()


def test_free_appends_in_reverse_to_tail() -> None:
    m = make(num_blocks=5)
    m.allocate("a", 4 * BS)  # blocks 1..4
    m.free("a")
    # Tail blocks of the request come out first.
    assert m.allocate("b", 4 * BS)
    assert m.block_ids("b") == [4, 3, 2, 1]


def test_prefix_hit_shares_blocks() -> None:
    m = make()
    prompt = list(range(10))  # 2 full blocks + 2 tail tokens
    run_request(m, "a", prompt)
    match = m.match_prefix(prompt)
    assert match.block_ids == m.block_ids("a")[:2]
    assert match.num_tokens == 8
    assert m.allocate("b", len(prompt), match)
    a, b = m.block_ids("a"), m.block_ids("b")
    assert b[:2] == a[:2]
    assert b[2] != a[2]  # partial tail block is private
    assert m.refcount(a[0]) == 2 and m.refcount(a[1]) == 2
    assert m.refcount(a[2]) == 1 and m.refcount(b[2]) == 1
    assert m.num_used_blocks == 4
    m.check_invariants()


def test_partial_tail_not_cached() -> None:
    m = make()
    run_request(m, "a", list(range(6)))
    # The second block holds only 2 tokens: never published.
    assert m.match_prefix(list(range(8)) + [100]).num_tokens == 4


def test_divergent_prompt_matches_common_blocks_only() -> None:
    m = make()
    run_request(m, "a", list(range(12)))
    other = list(range(4)) + [50, 51, 52, 53] + list(range(8, 12)) + [1]
    match = m.match_prefix(other)
    assert match.block_ids == m.block_ids("a")[:1]


def test_cap_leaves_one_token() -> None:
    m = make()
    prompt = list(range(8))
    run_request(m, "a", prompt)
    assert m.match_prefix(prompt).num_tokens == 4  # exact multiple: last block withheld
    assert m.match_prefix(prompt + [9]).num_tokens == 8
    assert m.match_prefix(prompt[:1]).num_tokens == 0
    assert m.match_prefix([]).num_tokens == 0


def test_cache_blocks_incremental_and_idempotent() -> None:
    m = make()
    tokens = list(range(13))
    m.allocate("a", 13)
    m.cache_blocks("a", tokens, 5)  # one full block
    assert m.match_prefix(tokens).num_tokens == 4
    m.cache_blocks("a", tokens, 5)
    m.cache_blocks("a", tokens, 13)
    assert m.match_prefix(tokens).num_tokens == 12
    m.cache_blocks("a", tokens, 13)
    m.check_invariants()
    with pytest.raises(ValueError):
        m.cache_blocks("a", tokens + [0] * 8, 21)  # beyond allocated blocks


def test_duplicate_content_keeps_existing_mapping() -> None:
    m = make()
    tokens = list(range(9))
    m.allocate("a", 9)
    m.allocate("b", 9)  # same content, computed independently (no prefix passed)
    m.cache_blocks("a", tokens, 9)
    m.cache_blocks("b", tokens, 9)
    match = m.match_prefix(tokens)
    assert match.block_ids == m.block_ids("a")[:2]
    m.free("a")
    m.free("b")
    assert m.num_cached_free_blocks == 2  # b's duplicates stayed uncached
    m.check_invariants()


def test_hash_collision_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block hashes alike: only the stored-token check can tell them apart.
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, tokens, extra=None: 7)
    m = make()
    run_request(m, "a", [1, 2, 3, 4, 5])
    match = m.match_prefix([9, 9, 9, 9, 5])
    assert match.num_tokens == 0 and match.block_ids == []
    assert m.match_prefix([1, 2, 3, 4, 5]).num_tokens == 4
    # A colliding request keeps the existing mapping; its block stays uncached.
    run_request(m, "b", [9, 9, 9, 9, 5])
    assert m.match_prefix([1, 2, 3, 4, 5]).block_ids == m.block_ids("a")[:1]
    m.check_invariants()


def test_collision_stops_later_publication(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kv_cache.hash_block

    def fake(parent: int, tokens: tuple[int, ...], extra: object = None) -> int:
        if tokens in ((1, 1, 1, 1), (2, 2, 2, 2)):
            return 42  # the first blocks of the two prompts collide
        return real(parent, tokens, extra)

    monkeypatch.setattr(kv_cache, "hash_block", fake)
    m = make()
    run_request(m, "a", [1] * 4 + [0])
    run_request(m, "b", [2] * 4 + [3] * 4 + [0])
    # b's second block chains off hash 42, which is a's content: it must not be published.
    assert m.match_prefix([1] * 4 + [3] * 4 + [0]).num_tokens == 4
    assert m.match_prefix([2] * 4 + [3] * 4 + [0]).num_tokens == 0


def test_cached_blocks_survive_free_and_are_reused() -> None:
    m = make()
    prompt = list(range(9))
    run_request(m, "a", prompt)
    first_two = m.block_ids("a")[:2]
    m.free("a")
    assert m.num_used_blocks == 0
    assert m.num_cached_free_blocks == 2
    assert m.num_free_blocks == 8
    match = run_request(m, "b", prompt)
    assert match.block_ids == first_two
    assert m.block_ids("b")[:2] == first_two
    assert m.num_cached_free_blocks == 0  # matched blocks left the free list
    assert m.num_free_blocks == 5


def test_matched_block_leaves_free_list_without_eviction() -> None:
    m = make(num_blocks=4)  # 3 usable
    run_request(m, "a", list(range(9)))  # blocks 1,2 cached, 3 tail
    m.free("a")
    match = m.match_prefix(list(range(9)))
    assert match.num_tokens == 8
    # 3 free blocks in total, 2 of them are the prefix: only 1 new block is available.
    assert not m.allocate("b", 4 * BS, match)
    assert m.num_free_blocks == 3 and m.num_cached_free_blocks == 2
    assert m.allocate("b", 3 * BS, match)
    assert m.num_free_blocks == 0
    assert m.match_prefix(list(range(9))).num_tokens == 8  # still cached
    m.check_invariants()


def test_lru_evicts_least_recently_freed_first() -> None:
    m = make(num_blocks=5)  # 4 usable
    run_request(m, "a", [1] * 4)  # one full block: published by cache_blocks
    run_request(m, "b", [2] * 4)
    run_request(m, "c", [3] * 4)
    m.free("a")
    m.free("c")
    m.free("b")
    assert m.num_cached_free_blocks == 3
    # Free order: [unused block 4, a, c, b]. Two new blocks evict block 4 then a's block.
    assert m.allocate("d", 2 * BS)
    assert m.match_prefix([1] * 4 + [0]).num_tokens == 0
    assert m.match_prefix([3] * 4 + [0]).num_tokens == 4
    assert m.match_prefix([2] * 4 + [0]).num_tokens == 4
    assert m.num_cached_free_blocks == 2
    assert m.allocate("e", BS)  # evicts c's block next
    assert m.match_prefix([3] * 4 + [0]).num_tokens == 0
    assert m.match_prefix([2] * 4 + [0]).num_tokens == 4
    m.check_invariants()


def test_matching_refreshes_lru_position() -> None:
    m = make(num_blocks=4)  # 3 usable
    run_request(m, "a", [1] * 4)
    run_request(m, "b", [2] * 4)
    m.free("a")
    m.free("b")
    run_request(m, "c", [1] * 4 + [0])  # reuses a's cached block + 1 new block
    m.free("c")
    # Free order now: b's block, then c's tail, then a's block (freed most recently).
    assert m.allocate("d", BS)
    assert m.match_prefix([2] * 4 + [0]).num_tokens == 0
    assert m.match_prefix([1] * 4 + [0]).num_tokens == 4


def test_cached_blocks_evicted_under_pressure() -> None:
    m = make(num_blocks=5)
    run_request(m, "a", list(range(13)))  # 3 cached + tail = all 4 usable
    m.free("a")
    assert m.num_cached_free_blocks == 3
    assert m.allocate("b", 4 * BS)  # needs every block: all cached ones evicted
    assert m.num_cached_free_blocks == 0
    assert m.match_prefix(list(range(13))).num_tokens == 0
    m.check_invariants()


def test_stale_prefix_match_rejected() -> None:
    m = make(num_blocks=3)
    run_request(m, "a", list(range(5)))
    m.free("a")
    match = m.match_prefix(list(range(5)))
    assert match.num_tokens == 4
    assert m.allocate("x", 2 * BS)  # evicts the matched block
    m.free("x")
    with pytest.raises(ValueError):
        m.allocate("b", 5, match)


def test_disabled_prefix_caching_never_matches() -> None:
    m = make(enabled=False)
    prompt = list(range(9))
    run_request(m, "a", prompt)
    match = m.match_prefix(prompt)
    assert match.block_ids == [] and match.num_tokens == 0
    m.free("a")
    assert m.num_cached_free_blocks == 0
    assert m.prefix_queries == 18 and m.prefix_hits == 0
    m.check_invariants()


def test_stats_counters() -> None:
    m = make()
    run_request(m, "a", list(range(9)))  # queries 9, hits 0
    m.match_prefix(list(range(9)))  # queries 18, hits 8
    m.match_prefix(list(range(4)) + [7] * 5)  # queries 27, hits 12
    assert m.prefix_queries == 27
    assert m.prefix_hits == 12


def test_reset_prefix_cache() -> None:
    m = make()
    prompt = list(range(9))
    run_request(m, "a", prompt)
    assert not m.reset_prefix_cache()  # a block is in use
    assert m.match_prefix(prompt).num_tokens == 8
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.num_cached_free_blocks == 0
    assert m.num_free_blocks == 8
    assert m.match_prefix(prompt).num_tokens == 0
    m.check_invariants()


def test_null_block_never_handed_out() -> None:
    m = make(num_blocks=3)
    assert m.allocate("a", 2 * BS)
    assert 0 not in m.block_ids("a")
    assert not m.allocate("b", 1)


def _check_contents(
    m: KVCacheManager, content: dict[int, tuple[int, ...]], rid: str, tokens: list[int], n: int
) -> None:
    """Shadow model: a block's K/V depends on the whole prefix up to its end."""
    bs = m.block_size
    for i, b in enumerate(m.block_ids(rid)[: n // bs]):
        expected = tuple(tokens[: (i + 1) * bs])
        assert content.setdefault(b, expected) == expected, "block aliases other data"


def _random_manager(rng: random.Random) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=rng.randint(2, 24),
        block_size=rng.choice([1, 2, 4]),
        enable_prefix_caching=rng.random() < 0.8,
    )


@pytest.mark.parametrize("seed", range(30))
def test_randomized_invariants(seed: int) -> None:
    rng = random.Random(seed)
    m = _random_manager(rng)
    # A few shared "system prompts" make prefix hits likely.
    stems = [[rng.randint(0, 3) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    live: dict[str, list[int]] = {}  # id -> tokens (all computed)
    content: dict[int, tuple[int, ...]] = {}  # block -> token prefix its K/V encodes

    def grow(rid: str, tokens: list[int], match: PrefixMatch | None) -> bool:
        before = len(m.block_ids(rid))
        if not m.allocate(rid, len(tokens), match):
            return False
        fresh = m.block_ids(rid)[max(before, len(match.block_ids) if match else 0) :]
        for b in fresh:
            content.pop(b, None)  # about to be overwritten
        return True

    for step in range(300):
        op = rng.random()
        if op < 0.35 or not live:
            rid = f"r{step}"
            tokens = rng.choice(stems) + [rng.randint(0, 3) for _ in range(rng.randint(1, 10))]
            match = m.match_prefix(tokens)
            assert match.num_tokens <= len(tokens) - 1
            assert match.num_tokens == len(match.block_ids) * m.block_size
            _check_contents_match(content, match, tokens, m.block_size)
            if grow(rid, tokens, match):
                assert m.block_ids(rid)[: len(match.block_ids)] == match.block_ids
                live[rid] = tokens
        elif op < 0.55:
            rid = rng.choice(sorted(live))
            tokens = live[rid] + [rng.randint(0, 3) for _ in range(rng.randint(1, 5))]
            if grow(rid, tokens, None):
                live[rid] = tokens
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            n = rng.randint(0, len(live[rid]))
            _check_contents(m, content, rid, live[rid], n)
            m.cache_blocks(rid, live[rid], n)
        elif op < 0.97:
            victim = rng.choice(sorted(live))
            del live[victim]
            m.free(victim)
        else:
            assert m.reset_prefix_cache() == (m.num_used_blocks == 0)
        m.check_invariants()
        assert 0.0 <= m.usage <= 1.0
    for rid in list(live):
        m.free(rid)
        m.check_invariants()
    assert all(m.refcount(b) == 0 for b in range(m.num_blocks))
    assert m.num_free_blocks == m.num_blocks - 1
    assert m.prefix_hits <= m.prefix_queries


def _check_contents_match(
    content: dict[int, tuple[int, ...]], match: PrefixMatch, tokens: list[int], bs: int
) -> None:
    for i, b in enumerate(match.block_ids):
        assert content[b] == tuple(tokens[: (i + 1) * bs]), "prefix hit on wrong data"


def test_prefix_match_is_per_extra_key() -> None:
    """Blocks published under one LoRA adapter's key are hits only for that key."""
    m = make()
    tokens = list(range(1, 10))  # two full blocks and one token
    for rid, extra in (("base", None), ("a1", (1,))):
        assert m.allocate(rid, len(tokens), extra=extra)
        m.cache_blocks(rid, tokens, len(tokens))
    assert m.match_prefix(tokens).block_ids == m.block_ids("base")[:2]
    assert m.match_prefix(tokens, (1,)).block_ids == m.block_ids("a1")[:2]
    assert m.match_prefix(tokens, (2,)).num_tokens == 0
    m.check_invariants()
