"""KV block accounting: free list, reference counts, and the prefix cache.

A full block of tokens is identified by a hash chained over all blocks before it, so two
requests share a block only when their whole prefix up to and including it is identical.
Blocks whose reference count drops to zero keep their contents and hash in an LRU list and
are reused by a later request with the same prefix, or evicted (oldest first) when the free
list is empty. Running out of blocks is reported by ``can_allocate`` / ``can_append`` returning
False; the scheduler decides what to do (wait or preempt). Nothing here raises for it.

Block arithmetic lives here too: where a token's KV goes (`slot_of`, `slots_of`). Whether a
sequence's newest token starts a block, or a step just filled one, the scheduler's decode loop
tests inline (a call per row and step costs more than the test).
A sequence's block table is replaced, never changed in place: the model runner keeps the rows
it staged by the table they came from and rewrites a row only when that table is another one.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional

from rosecli.engine.errors import RequestError
from rosecli.engine.sequence import Sequence


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The KV cache slot of the token at ``position`` in a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of the tokens at positions ``start .. end - 1``: one range per block."""
    out: list[int] = []
    p = start
    while p < end:
        block, offset = divmod(p, block_size)
        n = min(block_size - offset, end - p)
        first = block_table[block] * block_size + offset
        out.extend(range(first, first + n))
        p += n
    return out


def _chain_hash(parent: Optional[int], tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


def check_group(config, blocks, n: int, num_prompt_tokens: int) -> None:
    """Whether ``n`` choices of a prompt (`Scheduler.add_group`) can ever run together, from the
    `EngineConfig` and the KV pool's size alone (``blocks``: what has ``num_blocks`` and
    ``blocks_needed``; a server whose engine runs in another process has no scheduler): a
    RequestError naming ``n`` otherwise. Each choice needs a block of its own for its first token."""
    max_active = config.max_active_requests or config.max_batch_size
    rows = min(max_active, max(config.max_batch_size, config.prefill_max_batch_size))
    if n > rows:
        raise RequestError(f"n={n} is more choices than this engine runs at once ({rows}: --max-batch-size / "
                           "--max-active-requests)", "n")
    need = blocks.blocks_needed(num_prompt_tokens + 1) + n - 1
    if need > blocks.num_blocks:
        raise RequestError(f"n={n}: the prompt's {num_prompt_tokens} tokens and a block for each choice need "
                           f"{need} KV blocks, the whole KV cache has {blocks.num_blocks}", "n")


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
        its logits are always computed (a fully cached prompt still yields a first token). A request
        that asked for prompt logprobs computes its whole prompt: a cached block has no logits."""
        if not self.enable_prefix_cache or seq.params.prompt_logprobs is not None:
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
        table = []
        for block in hits:
            if self.ref_counts[block] == 0:
                self.evictable.pop(block, None)
            self.ref_counts[block] += 1
            table.append(block)
            seq.block_hashes.append(self.block_hash[block])
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_prefix_cache:
            self.prefix_queried_tokens += len(seq.token_ids)
            self.prefix_hit_tokens += seq.num_cached_tokens
        for _ in range(self.blocks_needed(len(seq.token_ids)) - len(hits)):
            table.append(self._take_block())
        seq.block_table = table

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

    def fork(self, parent: Sequence, child: Sequence) -> Optional[tuple[int, int]]:
        """Give ``child`` (the same tokens as ``parent``, computed by it) ``parent``'s KV: the full
        blocks shared (reference counts), a partly filled last block as a block of its own, whose
        contents the caller copies: returns that (source, destination) pair, or None. Needs one
        free block when the last is partial (reserved at admission)."""
        table = list(parent.block_table)
        for block in table:
            self.ref_counts[block] += 1
        pair = None
        if parent.num_computed_tokens % self.block_size:
            src = table[-1]
            self.ref_counts[src] -= 1
            table[-1] = self._take_block()
            pair = (src, table[-1])
        child.block_table = table
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = parent.num_computed_tokens
        return pair

    def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
        """Whether ``seq`` can grow to ``len(seq) + num_tokens - 1`` tokens' worth of slots."""
        need = self.blocks_needed(len(seq.token_ids) + num_tokens - 1) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Make sure every token of ``seq`` has a slot (called before a decode step)."""
        table = list(seq.block_table)
        while len(table) < self.blocks_needed(len(seq.token_ids)):
            table.append(self._take_block())
        seq.block_table = table

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
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-unreferenced block (benchmarks call this between runs)."""
        while self.evictable:
            self.free_ids.append(self._evict_oldest())
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
