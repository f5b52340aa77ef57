"""KV block accounting: free list, reference counts, and the prefix cache.

A full block of tokens is identified by a hash chained over all blocks before it, so two
requests share a block only when their whole prefix up to and including it is identical.
Blocks whose reference count drops to zero keep their contents and hash in an LRU list and
are reused by a later request with the same prefix, or evicted (oldest first) when the free
list is empty. Running out of blocks is reported by ``can_allocate`` / ``can_append`` returning
False; the scheduler decides what to do (wait or preempt). Nothing here raises for it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Optional

from rosecli.engine.sequence import Sequence


def _chain_hash(parent: Optional[int], tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.block_tokens: list[Optional[tuple]] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU order
        # prefix-cache statistics, in prompt tokens
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self._versions = itertools.count(1)

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of the sequence. The last token is never cached, so
        its logits are always computed (a fully cached prompt still yields a first token)."""
        if not self.enable_prefix_cache:
            return []
        hits: list[int] = []
        parent = None
        bs = self.block_size
        for i in range((len(seq.token_ids) - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = _chain_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tuple(tokens):
                break
            hits.append(block)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether blocks for all of ``seq``'s tokens fit, keeping ``reserve`` blocks free."""
        hits = self._cached_prefix(seq)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        new = self.blocks_needed(len(seq.token_ids)) - len(hits)
        return new + revived + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` a block table covering all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        parent = None
        for i, block in enumerate(hits):
            if self.ref_counts[block] == 0:
                self.evictable.pop(block, None)
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            parent = self.block_hash[block]
            seq.block_hashes.append(parent)
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_prefix_cache:
            self.prefix_queried_tokens += len(seq.token_ids)
            self.prefix_hit_tokens += seq.num_cached_tokens
        for _ in range(self.blocks_needed(len(seq.token_ids)) - len(hits)):
            seq.block_table.append(self._take_block())
        seq.table_version = next(self._versions)

    def _evict_oldest(self) -> int:
        """Take the least recently freed cached block out of the prefix cache."""
        block, _ = self.evictable.popitem(last=False)
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None
        return block

    def _take_block(self) -> int:
        block = self.free_ids.popleft() if self.free_ids else self._evict_oldest()
        self.block_hash[block] = None
        self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
        """Whether ``seq`` can grow to ``len(seq) + num_tokens - 1`` tokens' worth of slots."""
        need = self.blocks_needed(len(seq.token_ids) + num_tokens - 1) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Make sure every token of ``seq`` has a slot (called before a decode step)."""
        while len(seq.block_table) < self.blocks_needed(len(seq.token_ids)):
            seq.block_table.append(self._take_block())
        seq.table_version = next(self._versions)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose KV is now fully computed, for later requests."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        while (seq.num_hashed_blocks + 1) * bs <= seq.num_computed_tokens:
            i = seq.num_hashed_blocks
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = _chain_hash(parent, tokens)
            block = seq.block_table[i]
            self.block_hash[block] = h
            self.block_tokens[block] = tuple(tokens)
            self.hash_to_block.setdefault(h, block)
            seq.block_hashes.append(h)
            seq.num_hashed_blocks += 1

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (reverse order, so a prefix's tail is evicted before its head)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None and self.hash_to_block.get(self.block_hash[block]) == block:
                    self.evictable[block] = None
                else:
                    self.block_hash[block] = None
                    self.block_tokens[block] = None
                    self.free_ids.append(block)
        seq.block_table = []
        seq.table_version = next(self._versions)
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-unreferenced block (benchmarks call this between runs)."""
        while self.evictable:
            self.free_ids.append(self._evict_oldest())
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
