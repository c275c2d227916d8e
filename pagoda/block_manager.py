"""The KV block pool: free list, reference counts and automatic prefix caching.

Blocks are plain integer ids handed to the scheduler as lists. A full block's content is
looked up by a chained hash `H(parent hash, token ids, extra keys)` (sha256, the same in every
process), so a request whose prompt starts like an earlier one reuses that KV. A hit is
verified exactly, never trusted to the hash: the block must hold the same token ids and hang
off the same parent content. Each full block gets a `prefix_id` naming its whole token prefix
(equal ids only for verified-equal prefixes) and keeps its parent's, so a collision can at
worst cost a hit, never serve another prefix's KV.

Invariants (see `check`): every block is either referenced (ref_cnt > 0) or in the free queue,
never both; a block has a hash exactly when `cached` maps that hash to it. A block freed by
its last user keeps its hash and stays in the free queue in LRU order until it is reused:
reviving it is O(1). Blocks with nothing cached are reused first.

A manager given a `sliding_window` serves layers that attend only to the last `window`
positions (Gemma 3's local layers; vLLM's `SlidingWindowManager`): once a request has computed
`c` tokens, no query of it will read a key before `c - window + 1`, so the blocks wholly before
that are released and replaced in its table by `NULL_BLOCK` (block 0, reserved, never
allocated: the native kernel never reads it, the torch path masks it). A long request then
holds about window / block_size + 1 blocks. `group` names the request's table this manager
fills: 0 `block_ids`, 1 `sliding_block_ids` (kv_cache_manager.py).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from pagoda.kv_cache import group_block_ids
from pagoda.request import Request

ExtraKeys = bytes | tuple[int | str | bytes, ...]

NULL_BLOCK = 0  # NOTE: a sliding-window manager's placeholder for released blocks


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: ExtraKeys = ()) -> bytes:
    """The content hash of one full block, chained on its parent's hash.

    Args:
        parent: the previous block's hash; None for a request's first block.
        token_ids: the block's token ids.
        extra: whatever else the KV depends on (a LoRA id, image hashes); a tuple is hashed
            through its repr, so it must hold only ints, strings and bytes.
    """
    h = hashlib.sha256(parent or b"\x00")
    h.update(array("q", token_ids).tobytes())
    if extra:
        data = extra if isinstance(extra, bytes) else repr(extra).encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


class Block:
    """One KV block; `prefix_id` is 0 until its content is named (full and scheduled)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prefix_id", "parent_prefix_id",
                 "touched")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.touched = False
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.prefix_id = 0
        self.parent_prefix_id = 0

    def forget(self) -> None:
        self.block_hash, self.token_ids = None, ()
        self.prefix_id = self.parent_prefix_id = 0


class BlockManager:
    """Allocates KV blocks to requests; shares full blocks by content when caching is on."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, group: int = 0) -> None:
        if sliding_window is not None and num_blocks < 2:
            raise ValueError(f"a sliding-window pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.group = group
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict is the LRU free queue: O(1) append, pop-oldest and removal.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        if sliding_window is not None:
            del self.free_queue[NULL_BLOCK]
            self.blocks[NULL_BLOCK].ref_cnt = 1  # NOTE: held by no request, never freed
        self.cached: dict[bytes, Block] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # NOTE: blocks ever handed out; on CPU only their pages are resident, so RSS grows with
        # this count (up to the pool) without any leak.
        self.num_blocks_touched = 0
        self._prefix_ids = itertools.count(1)
        # request key -> how many of its leading blocks are named (each step names only new ones)
        self._num_named_blocks: dict[tuple[str, int], int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but a sliding-window pool's null block."""
        return self.num_blocks - (self.sliding_window is not None)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def block_ids_of(self, request: Request) -> list[int]:
        """The request's table in this manager's group."""
        return group_block_ids(request, self.group)

    def _set_block_ids(self, request: Request, block_ids: list[int]) -> None:
        if self.group == 0:
            request.block_ids = block_ids
        else:
            request.sliding_block_ids = block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[bytes]:
        """Extends and returns the hashes of the request's full blocks; the first takes the
        request's cache salt (vLLM's `cache_salt`) and its LoRA adapter, which every later one
        chains on."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        salt = request.cache_salt.encode("utf-8", "surrogatepass") if request.cache_salt else b""
        if request.lora_request is not None:
            salt += b"\0" + request.lora_request.cache_key.encode("utf-8", "surrogatepass")
        for i in range(len(hashes), len(tokens) // bs):
            block = tokens[i * bs:(i + 1) * bs]
            hashes.append(hash_block(hashes[-1], block) if hashes else hash_block(None, block, salt))
        return hashes

    def takes_prefix_hits(self, request: Request) -> bool:
        """Whether `request` may reuse cached blocks: not when it wants prompt logprobs, which
        need the logits of every prompt row (vLLM v1's rule), nor when it mean-pools every
        prompt row's hidden state (pooling.py); its own blocks are still cached."""
        pooling = request.pooling_params
        return (self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None
                and not (pooling is not None and pooling.pools_every_row))

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The longest cached prefix of the request, in whole blocks, never its last token."""
        if not self.takes_prefix_hits(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[Block] = []
        parent_id = 0
        for i, h in enumerate(self.block_hashes(request)[:max_blocks]):
            block = self.cached.get(h)
            if (block is None or block.parent_prefix_id != parent_id
                    or block.token_ids != tuple(request.all_token_ids[i * bs:(i + 1) * bs])):
                break
            hits.append(block)
            parent_id = block.prefix_id
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[Block] | None = None) -> bool:
        """Gives `request` blocks for `num_new_tokens` more tokens (after `computed` hits).

        `computed` (from `get_computed_blocks`) may only be given to a request holding no
        blocks. Returns False, changing nothing, when the pool cannot supply them.
        """
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        self.commit_slots(request, num_new_tokens, computed)
        return True

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: list[Block] | None = None) -> bool:
        """Whether `allocate_slots` would succeed (it changes nothing)."""
        computed = computed or []
        block_ids = self.block_ids_of(request)
        assert not (computed and block_ids), "prefix hits for a request that holds blocks"
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(block_ids) - len(computed)
        num_skipped = self._num_skipped_blocks(num_computed, len(computed) or len(block_ids))
        revived = sum(1 for b in computed[num_skipped:] if b.ref_cnt == 0)
        # NOTE: blocks leaving the window now are released before new ones are taken.
        released = sum(1 for i in block_ids[:num_skipped] if i != NULL_BLOCK and self.blocks[i].ref_cnt == 1)
        return needed + revived <= self.num_free_blocks + released

    def commit_slots(self, request: Request, num_new_tokens: int, computed: list[Block] | None = None) -> None:
        """`allocate_slots` once `can_allocate` said yes."""
        computed = computed or []
        block_ids = self.block_ids_of(request)
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        self._release_skipped(block_ids, num_computed)
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(block_ids) - len(computed)
        num_skipped = self._num_skipped_blocks(num_computed, len(computed))
        block_ids.extend([NULL_BLOCK] * num_skipped)
        for block in computed[num_skipped:]:
            self._touch(block)
            block_ids.append(block.block_id)
        for _ in range(max(needed, 0)):
            block_ids.append(self._pop_free().block_id)
        if computed:
            request.num_computed_tokens = num_computed
            # NOTE: hit blocks are named already; naming resumes after the last of them.
            self._num_named_blocks[request.key] = len(computed)
        self._cache_full_blocks(request, num_computed + num_new_tokens)

    def _num_skipped_blocks(self, num_computed: int, num_blocks: int) -> int:
        """How many of a table's first `num_blocks` blocks no query after `num_computed` reads
        (0 without a sliding window); a table's last block is always kept."""
        if self.sliding_window is None or num_blocks == 0:
            return 0
        first_seen = max(num_computed - self.sliding_window + 1, 0)
        return min(first_seen // self.block_size, num_blocks - 1)

    def _release_skipped(self, block_ids: list[int], num_computed: int) -> None:
        """Releases the blocks that left the window, latest first (so that the earliest are
        evicted last, as in `free`); the released ones form a prefix of NULL_BLOCKs."""
        for i in reversed(range(self._num_skipped_blocks(num_computed, len(block_ids)))):
            if block_ids[i] == NULL_BLOCK:
                break
            self._release(self.blocks[block_ids[i]])
            block_ids[i] = NULL_BLOCK

    def free(self, request: Request) -> None:
        """Releases the request's blocks; cached ones stay revivable until evicted.

        NOTE: tail blocks go first into the queue, so a prefix's later blocks are evicted
        before its earlier ones (a child is never cached without its parent being reachable).
        """
        for block_id in reversed(self.block_ids_of(request)):
            if block_id == NULL_BLOCK and self.sliding_window is not None:
                break  # NOTE: released already, as every table entry before it
            self._release(self.blocks[block_id])
        self._set_block_ids(request, [])
        self._num_named_blocks.pop(request.key, None)

    def _release(self, block: Block) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = block
            if block.block_hash is None:
                # NOTE: blocks with nothing worth keeping are reused first.
                self.free_queue.move_to_end(block.block_id, last=False)

    def uncache(self, request: Request, from_block: int = 0) -> None:
        """Forgets the hashes of the request's blocks from `from_block` on (content untrusted)."""
        for block_id in self.block_ids_of(request)[from_block:]:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.forget()

    def reset_prefix_cache(self) -> None:
        """Forgets every free cached block (blocks in use keep theirs)."""
        for block in self.free_queue.values():
            if block.block_hash is not None:
                del self.cached[block.block_hash]
            block.forget()

    def _touch(self, block: Block) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            del self.cached[block.block_hash]
        block.forget()
        block.ref_cnt = 1
        if not block.touched:
            block.touched = True
            self.num_blocks_touched += 1
        return block

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Names (and caches) the request's blocks that `num_tokens` tokens fill.

        NOTE: blocks are named when scheduled, before the step computes them; a request that
        hits them in the same step reads K/V the layer writes before it attends.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(request)
        block_ids = self.block_ids_of(request)
        start = self._num_named_blocks.get(request.key, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        parent_id = self.blocks[block_ids[start - 1]].prefix_id if start else 0
        for i in range(start, end):
            if i > 0 and parent_id == 0:
                break  # NOTE: the parent was uncached (or left the window) under us; its successors stay unnamed.
            block = self.blocks[block_ids[i]]
            if self.sliding_window is not None and block.block_id == NULL_BLOCK:
                break
            if block.prefix_id == 0:
                self._name_block(block, hashes[i], self._block_tokens(request, i), parent_id)
            parent_id = block.prefix_id
        self._num_named_blocks[request.key] = max(start, end)

    def _name_block(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...],
                    parent_id: int) -> None:
        """Gives a full block its prefix id and caches it unless its hash is taken."""
        other = self.cached.get(block_hash)
        if other is not None and other.token_ids == token_ids and other.parent_prefix_id == parent_id:
            # NOTE: the same prefix computed twice (e.g. by n > 1 siblings): share its name so
            # that blocks after it still chain, but keep the block that was cached first.
            block.prefix_id = other.prefix_id
        else:
            block.prefix_id = next(self._prefix_ids)
            if other is None:
                block.block_hash = block_hash
                self.cached[block_hash] = block
        block.token_ids = token_ids
        block.parent_prefix_id = parent_id

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(request.all_token_ids[index * bs:(index + 1) * bs])

    # ---- integrity -----------------------------------------------------------------------
    def check(self) -> None:
        """Asserts the pool's invariants; tests and idle engines call it."""
        used = [b for b in self.blocks if b.ref_cnt > 0]
        if self.sliding_window is not None:
            null = self.blocks[NULL_BLOCK]
            assert null.ref_cnt == 1 and null.block_hash is None, "the null block was handed out"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(self.free_queue) == self.num_blocks, (
            f"free ({len(self.free_queue)}) + used ({len(used)}) != total ({self.num_blocks})")
        assert all(b.ref_cnt == 0 for b in self.free_queue.values()), "referenced block in free queue"
        assert all(k == b.block_id for k, b in self.free_queue.items()), "free queue key mismatch"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"cached block {block.block_id} has a stale hash"
            assert len(block.token_ids) == self.block_size and block.prefix_id > 0, (
                f"cached block {block.block_id} is not a named full block")
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the cache does not map to it")
        prefix_ids = [b.prefix_id for b in self.cached.values()]
        assert len(set(prefix_ids)) == len(prefix_ids), "two cached blocks share a prefix id"
