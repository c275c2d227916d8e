"""KV cache groups of a model mixing global and sliding-window layers (Gemma 3).

vLLM's hybrid KV cache manager, for pagoda's two kinds of layer: the full-attention layers'
blocks (group 0, `Request.block_ids`) hold every token, the sliding-window layers' (group 1,
`Request.sliding_block_ids`) only those their window can still see (block_manager.py), each
group from its own pool with its own block ids. `HybridBlockManager` offers the scheduler and
the engine core the `BlockManager` calls they use, applied to both groups: an allocation
succeeds in both or changes neither. Prefix caching (vLLM's rule for a sliding window): a
hit of the full group is kept up to the longest point whose last window's blocks are cached in
the sliding group too (the blocks before it are NULL_BLOCK, never read). A sliding block is
named with the prefix id of the full block at its place (`_name_sliding`), so it is reused
only for a prefix the full group verified token for token; a miss only cuts the hit short.
A model whose layers all attend alike keeps one plain `BlockManager`, as before.
"""

from __future__ import annotations

from pagoda.block_manager import NULL_BLOCK, Block, BlockManager
from pagoda.request import Request


class HybridBlockManager:
    """A full-attention group and a sliding-window group, allocated together.

    Args:
        full: group 0's manager (every token's block).
        sliding: group 1's manager, with its `sliding_window` and its own caching off (this
            class names its blocks).
    """

    def __init__(self, full: BlockManager, sliding: BlockManager) -> None:
        assert full.group == 0 and sliding.group == 1 and sliding.sliding_window is not None
        assert full.block_size == sliding.block_size and not sliding.enable_prefix_caching
        self.full = full
        self.sliding = sliding
        self.groups = (full, sliding)
        self.block_size = full.block_size
        # request key -> how many of its leading sliding blocks were considered for naming
        self._num_named: dict[tuple[str, int], int] = {}

    @property
    def usage(self) -> float:
        return max(g.usage for g in self.groups)

    # ---- the scheduler's calls ---------------------------------------------------------------
    def takes_prefix_hits(self, request: Request) -> bool:
        return self.full.takes_prefix_hits(request)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_prefix_query(num_tokens, num_hit_tokens)

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The full group's hit blocks, cut to the longest prefix whose last window is cached
        in the sliding group too."""
        full = self.full.get_computed_blocks(request)
        return full[:len(self._sliding_hits(request, full))]

    def _sliding_hits(self, request: Request, full: list[Block]) -> list[Block]:
        """The sliding group's blocks for the longest usable part of `full`: NULL_BLOCK's
        before the window, then cached blocks named like the full group's at their place."""
        hashes = request.block_hashes
        run = 0  # NOTE: matching sliding blocks ending at index j - 1
        runs: list[int] = []
        found: list[Block | None] = []
        for i, block in enumerate(full):
            local = self.sliding.cached.get(hashes[i])
            found.append(local if local is not None and local.prefix_id == block.prefix_id else None)
            run = run + 1 if found[-1] is not None else 0
            runs.append(run)
        for j in range(len(full), 0, -1):
            first = self.sliding._num_skipped_blocks(j * self.block_size, j)
            if runs[j - 1] >= j - first:
                null = self.sliding.blocks[NULL_BLOCK]
                return [null] * first + [b for b in found[first:j] if b is not None]
        return []

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[Block] | None = None) -> bool:
        """Both groups' blocks for `num_new_tokens` more tokens, or False, changing nothing."""
        computed = computed or []
        sliding_hits = self._sliding_hits(request, computed) if computed else []
        assert len(sliding_hits) == len(computed), "the sliding group lost a hit it offered"
        if not (self.full.can_allocate(request, num_new_tokens, computed)
                and self.sliding.can_allocate(request, num_new_tokens, sliding_hits)):
            return False
        num_computed = request.num_computed_tokens
        self.full.commit_slots(request, num_new_tokens, computed)
        request.num_computed_tokens = num_computed
        self.sliding.commit_slots(request, num_new_tokens, sliding_hits)
        if computed:
            self._num_named[request.key] = len(computed)
        self._name_sliding(request)
        return True

    def _name_sliding(self, request: Request) -> None:
        """Names (and caches) the sliding blocks at the places of newly named full blocks:
        the full block's hash, tokens and prefix id (kept unless another holds the hash)."""
        if not self.full.enable_prefix_caching:
            return
        full_ids, local_ids = request.block_ids, request.sliding_block_ids
        start = self._num_named.get(request.key, 0)
        end = start
        for i in range(start, min(len(full_ids), len(local_ids), len(request.block_hashes))):
            source = self.full.blocks[full_ids[i]]
            if source.prefix_id == 0:
                break
            end = i + 1
            block = self.sliding.blocks[local_ids[i]]
            if local_ids[i] == NULL_BLOCK or block.prefix_id:
                continue
            block.prefix_id, block.parent_prefix_id = source.prefix_id, source.parent_prefix_id
            block.token_ids = source.token_ids
            if request.block_hashes[i] not in self.sliding.cached:
                block.block_hash = request.block_hashes[i]
                self.sliding.cached[block.block_hash] = block
        self._num_named[request.key] = end

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)
        self._num_named.pop(request.key, None)

    def uncache(self, request: Request, from_block: int = 0) -> None:
        for group in self.groups:
            group.uncache(request, from_block)

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.reset_prefix_cache()

    def check(self) -> None:
        for group in self.groups:
            group.check()
