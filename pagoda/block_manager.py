"""The KV block pool: free list, reference counts and automatic prefix caching.

Blocks are plain integer ids handed to the scheduler as lists. A full block's content is
named by a chained hash `H(parent hash, token ids)` (sha256, the same in every process), so a
request whose prompt starts like an earlier one reuses that KV. Invariants (see `check`):
every block is either referenced (ref_cnt > 0) or in the free queue, never both; a cached
hash maps to a block holding exactly those tokens. A block freed by its last user keeps its
hash and stays in the free queue in LRU order until it is reused: reviving it is O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from pagoda.request import Request


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """The content hash of one full block, chained on its parent's hash."""
    h = hashlib.sha256(parent or b"\x00")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates KV blocks to requests; shares full blocks by content when caching is on."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict is the LRU free queue: O(1) append, pop-oldest and removal.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[bytes]:
        """Extends and returns the hashes of the request's full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The longest cached prefix of the request, in whole blocks, never its last token."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[Block] = []
        for i, h in enumerate(self.block_hashes(request)[:max_blocks]):
            block = self.cached.get(h)
            if block is None or block.token_ids != tuple(request.all_token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[Block] | None = None) -> bool:
        """Gives `request` blocks for `num_new_tokens` more tokens (after `computed` hits).

        Returns False, changing nothing, when the pool cannot supply them.
        """
        computed = computed or []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if needed + revived > self.num_free_blocks:
            return False
        for block in computed:
            self._touch(block)
            request.block_ids.append(block.block_id)
        for _ in range(max(needed, 0)):
            request.block_ids.append(self._pop_free().block_id)
        if computed:
            request.num_computed_tokens = num_computed
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        """Releases the request's blocks; cached ones stay revivable until evicted."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = block
                if block.block_hash is None:
                    # NOTE: blocks with nothing worth keeping are reused first.
                    self.free_queue.move_to_end(block_id, last=False)
        request.block_ids = []

    def uncache(self, request: Request) -> None:
        """Forgets the hashes of the request's blocks (their content is not trustworthy)."""
        for block_id in request.block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    def reset_prefix_cache(self) -> None:
        for block in self.free_queue.values():
            if block.block_hash is not None:
                self.cached.pop(block.block_hash, None)
                block.block_hash, block.token_ids = None, ()

    def _touch(self, block: Block) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self.block_hashes(request)
        for i in range(min(num_tokens // bs, len(hashes))):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            h = hashes[i]
            if h in self.cached:
                continue
            block.block_hash = h
            block.token_ids = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
            self.cached[h] = block

    # ---- integrity -----------------------------------------------------------------------
    def check(self) -> None:
        """Asserts the pool's invariants; tests and idle engines call it."""
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(self.free_queue) == self.num_blocks, (
            f"free ({len(self.free_queue)}) + used ({len(used)}) != total ({self.num_blocks})")
        assert all(b.ref_cnt == 0 for b in self.free_queue.values()), "referenced block in free queue"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"cached block {block.block_id} has a stale hash"
