"""Paged KV-cache block manager with hash-chained prefix caching.

The manager is the single owner of every KV block's bookkeeping: reference counts, the free
list (LRU order), the prefix-cache hash table and each request's block list. Requests are
referred to only by their string id.

Block lifecycle:
  * ref > 0   -> held by one or more requests, never in the free list.
  * ref == 0  -> in the free list. If it is also in the prefix cache it stays findable by
                 `match_prefix` until it is taken from the free list for new data (evicted).

Block 0 is a reserved null block: padding rows of a batch write their K/V there. It is never
handed out, cached, or counted as free or used.

With `enable_kv_cache_events`, every change of the prefix-cache hash table is recorded as a KV
cache event (photon.kv_events.schema) until `take_events()`: BlockStored when blocks are
published (a run of consecutive new blocks of one request per event), BlockRemoved when a cached
block is evicted, AllBlocksCleared on reset_prefix_cache. Applied in order, the events rebuild
exactly the set of hashes in the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

# hash_block is looked up in this module at each call, so tests can monkeypatch it here to force
# collisions; its values are the same in every process (photon.engine.block_hash).
from photon.engine.block_hash import ROOT_HASH, ExtraKeys, hash_block
from photon.kv_events.schema import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

NULL_BLOCK = 0


@dataclass
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)  # cached full blocks, in prompt order
    num_tokens: int = 0  # == len(block_ids) * block_size


@dataclass
class _PublishState:
    """How far a request's blocks have been published into the prefix cache."""

    num_blocks: int = 0  # blocks [0, num_blocks) were examined (published or deduplicated)
    last_hash: int = ROOT_HASH  # chain hash of block num_blocks - 1
    stopped: bool = False  # a collision broke the chain: later blocks are never published
    # What besides its tokens keys the request's blocks (its LoRA adapter): in every hash
    extra: ExtraKeys | None = None


@dataclass
class _CachedBlock:
    block_hash: int
    parent_hash: int
    tokens: tuple[int, ...]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_cache_events: bool = False):
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the reserved null block)")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._ref = [0] * num_blocks
        # Free list in LRU order: head = next block handed out. Values unused (ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._cached: dict[int, _CachedBlock] = {}  # block id -> its prefix-cache entry
        self._num_cached_free = 0  # blocks with ref == 0 that are in _cached
        self._req_blocks: dict[Hashable, list[int]] = {}
        self._req_publish: dict[Hashable, _PublishState] = {}
        # Events not yet taken; None: not recorded.
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events since the last call, in order (empty when not recorded)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    # ------------------------------------------------------------------ observability
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    def refcount(self, block_id: int) -> int:
        return self._ref[block_id]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: Hashable) -> list[int]:
        """A copy of the request's block table (empty for an unknown id)."""
        return list(self._req_blocks.get(request_id, ()))

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's live block list, without a copy: read it, never mutate it. Valid until
        the next allocate/free of that request (the hot loop reads it right after planning)."""
        return self._req_blocks[request_id]

    def needs_publish(self, request_id: Hashable, num_tokens: int) -> bool:
        """Cheap check whether cache_blocks(request_id, ..., num_tokens) would publish a block."""
        state = self._req_publish.get(request_id)
        return (self.enable_prefix_caching and state is not None and not state.stopped
                and num_tokens // self.block_size > state.num_blocks)

    # ------------------------------------------------------------------ prefix lookup
    def match_prefix(self, token_ids: Sequence[int], extra: ExtraKeys | None = None
                     ) -> PrefixMatch:
        """Longest run of cached full blocks equal to the prompt's prefix, among the blocks
        published with the same `extra` (a LoRA adapter's blocks never serve the base model or
        another adapter). Takes no references."""
        self.prefix_queries += len(token_ids)
        if not self.enable_prefix_caching:
            return PrefixMatch()
        bs = self.block_size
        # Leave at least one token to compute so the request produces logits.
        max_blocks = max(len(token_ids) - 1, 0) // bs
        parent = ROOT_HASH
        blocks: list[int] = []
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens, extra)
            block = self._hash_to_block.get(h)
            if block is None:
                break
            entry = self._cached[block]
            # Collision check: a hash hit is trusted only if the stored content agrees.
            if entry.tokens != tokens or entry.parent_hash != parent:
                break
            blocks.append(block)
            parent = h
        num_tokens = len(blocks) * bs
        self.prefix_hits += num_tokens
        return PrefixMatch(block_ids=blocks, num_tokens=num_tokens)

    # ------------------------------------------------------------------ allocation
    def allocate(self, request_id: Hashable, num_tokens: int, prefix: PrefixMatch | None = None,
                 extra: ExtraKeys | None = None) -> bool:
        """Grow the request to ceil(num_tokens / block_size) blocks. All or nothing. `extra`
        (the first allocation's): the keys its blocks publish under, as `match_prefix`'s."""
        held = self._req_blocks.get(request_id)
        if prefix is None and held is not None and num_tokens <= len(held) * self.block_size:
            return True  # the common decode step: the last block still has room
        prefix_blocks = prefix.block_ids if prefix is not None else []
        if prefix_blocks:
            self._validate_prefix(request_id, held, num_tokens, prefix_blocks)
        num_held = len(held) if held is not None else len(prefix_blocks)
        num_new = max(self.num_blocks_needed(num_tokens) - num_held, 0)
        # Prefix blocks at ref 0 sit in the free list but cannot also serve as new blocks.
        reserved = sum(1 for b in prefix_blocks if self._ref[b] == 0)
        if num_new > len(self._free) - reserved:
            return False
        if held is None:
            held = self._req_blocks[request_id] = []
            state = self._req_publish[request_id] = self._take_prefix(held, prefix_blocks)
            state.extra = extra
        for _ in range(num_new):
            held.append(self._take_free_block())
        return True

    def _validate_prefix(
        self, request_id: Hashable, held: list[int] | None, num_tokens: int, blocks: list[int]
    ) -> None:
        if held is not None:
            raise ValueError(f"prefix passed for request {request_id!r} that already has blocks")
        if len(blocks) * self.block_size > num_tokens:
            raise ValueError("num_tokens is smaller than the prefix match")
        for b in blocks:
            # A stale match (block evicted since match_prefix) would alias someone else's data.
            if b not in self._cached:
                raise ValueError(f"stale PrefixMatch: block {b} is no longer cached")

    def _take_prefix(self, held: list[int], blocks: list[int]) -> _PublishState:
        """Reference the matched blocks; returns the publish state they already satisfy."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]  # leaves the free list without eviction: its hash stays
                self._num_cached_free -= 1
            self._ref[b] += 1
            held.append(b)
        if not blocks:
            return _PublishState()
        return _PublishState(len(blocks), self._cached[blocks[-1]].block_hash)

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        if block in self._cached:
            self._evict(block)
        self._ref[block] = 1
        return block

    def _evict(self, block: int) -> None:
        entry = self._cached.pop(block)
        del self._hash_to_block[entry.block_hash]
        if self._ref[block] == 0:
            self._num_cached_free -= 1
        events = self._events
        if events is not None:
            last = events[-1] if events else None
            if isinstance(last, BlockRemoved):  # evictions of one step share an event
                last.block_hashes.append(entry.block_hash)
            else:
                events.append(BlockRemoved([entry.block_hash], MEDIUM_GPU))

    # ------------------------------------------------------------------ publishing
    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Publish every full block within the request's first `num_tokens` tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks[request_id]
        state = self._req_publish[request_id]
        bs = self.block_size
        num_full = num_tokens // bs
        if num_full > len(blocks) or num_tokens > len(token_ids):
            raise ValueError("cache_blocks beyond the request's allocated blocks or known tokens")
        run: BlockStored | None = None  # the event of this call's latest new blocks
        while state.num_blocks < num_full and not state.stopped:
            i = state.num_blocks
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(state.last_hash, tokens, state.extra)
            new = h not in self._hash_to_block
            if not self._publish_one(blocks[i], h, state.last_hash, tokens):
                # Collision: later hashes would chain off content that is not ours.
                state.stopped = True
                break
            if self._events is not None:
                run = self._record_stored(run, new, i, h, state.last_hash, tokens, state.extra)
            state.num_blocks = i + 1
            state.last_hash = h

    def _record_stored(self, run: BlockStored | None, new: bool, index: int, h: int,
                       parent: int, tokens: tuple[int, ...], extra: ExtraKeys | None
                       ) -> BlockStored | None:
        """Extend the current BlockStored with a newly cached block (or start one); a block
        already cached elsewhere ends the run. Returns the run to extend next."""
        if not new:
            return None
        if run is not None:
            run.block_hashes.append(h)
            run.token_ids.extend(tokens)
            return run
        lora_id = extra[0] if extra and isinstance(extra[0], int) else None
        run = BlockStored([h], None if index == 0 else parent, list(tokens), self.block_size,
                          lora_id, MEDIUM_GPU)
        assert self._events is not None
        self._events.append(run)
        return run

    def _publish_one(self, block: int, h: int, parent: int, tokens: tuple[int, ...]) -> bool:
        """Map h -> block unless h is taken. False iff h is taken by different content."""
        owner = self._hash_to_block.get(h)
        if owner is None:
            # A block handed out fresh was evicted when taken, so it cannot be cached already.
            assert block not in self._cached
            self._hash_to_block[h] = block
            self._cached[block] = _CachedBlock(h, parent, tokens)
            return True
        entry = self._cached[owner]
        # Same content elsewhere (or this very block): keep the existing mapping, continue.
        return entry.tokens == tokens and entry.parent_hash == parent

    # ------------------------------------------------------------------ release
    def shrink(self, request_id: Hashable, num_tokens: int) -> None:
        """Return the request's blocks past ceil(num_tokens / block_size) (space reserved ahead
        and not needed); published blocks are never returned. Unknown id: no-op."""
        blocks = self._req_blocks.get(request_id)
        if blocks is None:
            return
        keep = max(self.num_blocks_needed(num_tokens), self._req_publish[request_id].num_blocks)
        while len(blocks) > keep:
            self._release_block(blocks.pop())

    def _release_block(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free[b] = None
            if b in self._cached:
                self._num_cached_free += 1

    def free(self, request_id: Hashable) -> None:
        """Drop the request's references. Unknown id: no-op."""
        blocks = self._req_blocks.pop(request_id, None)
        self._req_publish.pop(request_id, None)
        if blocks is None:
            return
        # Reverse order: the request's tail blocks (least likely to be shared) go nearer the
        # head of the free list, so they are evicted before its prefix blocks.
        for b in reversed(blocks):
            self._release_block(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_used_blocks > 0:
            return False
        self._hash_to_block.clear()
        self._cached.clear()
        self._num_cached_free = 0
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        for rid, state in self._req_publish.items():  # requests holding zero blocks
            self._req_publish[rid] = _PublishState(extra=state.extra)
        return True

    # ------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Assert internal consistency (used by tests)."""
        assert self._ref[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free
        assert NULL_BLOCK not in self._cached
        counts = [0] * self.num_blocks
        for rid, blocks in self._req_blocks.items():
            assert len(set(blocks)) == len(blocks), f"duplicate block in {rid!r}"
            assert rid in self._req_publish
            assert self._req_publish[rid].num_blocks <= len(blocks)
            for b in blocks:
                assert 1 <= b < self.num_blocks
                counts[b] += 1
        assert counts == self._ref, "refcounts disagree with request block lists"
        free_set = {b for b in range(1, self.num_blocks) if self._ref[b] == 0}
        assert set(self._free) == free_set, "free list != blocks at ref 0"
        assert len(self._hash_to_block) == len(self._cached)
        for h, b in self._hash_to_block.items():
            assert self._cached[b].block_hash == h
            assert len(self._cached[b].tokens) == self.block_size
        cached_free = sum(1 for b in self._cached if self._ref[b] == 0)
        assert cached_free == self._num_cached_free
        if not self.enable_prefix_caching:
            assert not self._cached
