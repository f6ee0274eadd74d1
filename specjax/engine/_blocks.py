"""The prefix cache: a device pool of prompt blocks beside the engine's slots, and its host bookkeeping.

A block is `block_size` consecutive prompt positions of the target's KV cache and of the drafter's own
per-position cache (Proposer.new_cache), keyed by a hash chain: block k's key is sha256(key of block k-1,
its tokens), so a key names the whole prefix up to the block's end (vLLM v1's block hashes). Running requests
hold references to the blocks they matched or stored; a block nobody holds stays in the pool, in least
recently released order, until a new block needs its place (LRU eviction, as vLLM's free block queue).

Admission copies a request's matched blocks into a fresh cache row and prefills only the rest
(decoding.Prefix); after its prefill the row's new full blocks are copied into the pool. The slots stay
contiguous caches: the pool saves prefill compute and time to first token, not memory (docs/serving.md says
what measurement would justify paged attention instead).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.kv_cache import KVCache

ROOT = b"specjax-prefix-root"  # the parent key of a prompt's first block


def block_keys(tokens, block_size: int, limit: int) -> list[bytes]:
    """The hash-chain keys of the full blocks among tokens[:limit]."""
    keys, parent = [], ROOT
    for start in range(0, limit - block_size + 1, block_size):
        block = np.asarray(tokens[start:start + block_size], np.int64).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass
class PrefixStats:
    """Prefix cache counters since the engine started (vLLM's PrefixCacheStats: queries and hits in tokens)."""

    requests: int = 0
    queried_tokens: int = 0  # prompt tokens of the requests looked up
    hit_tokens: int = 0  # of them, read from the pool instead of prefilled
    queried_blocks: int = 0  # full blocks a request could have matched (those of its prompt but the last token)
    hit_blocks: int = 0  # blocks matched and used (after the EAGLE tail-block drop)
    dropped_blocks: int = 0  # matched blocks recomputed by the tail-block drop
    stored_blocks: int = 0
    evicted_blocks: int = 0
    full_pool: int = 0  # blocks not stored because every block of the pool was held

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (vLLM's prefix cache hit rate)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


class BlockTable:
    """The host's view of the pool: which key each block holds, its references, the LRU order of the free."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.by_key: dict[bytes, int] = {}
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.refs = np.zeros(num_blocks, np.int64)
        # Blocks no request holds, least recently released first (the never-used ones first of all).
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(num_blocks))

    def match(self, keys: list[bytes]) -> list[int]:
        """The pool blocks of the longest run of keys[0], keys[1], ... that the pool holds."""
        blocks = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] += 1
            self.free.pop(block, None)

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None  # most recently released: evicted last

    def allocate(self, key: bytes) -> tuple[int | None, bool]:
        """A block for key, held once: the least recently released free block (its old key forgotten).
        (block, whether a cached block was evicted); block None when every block is held."""
        if not self.free:
            return None, False
        block, _ = self.free.popitem(last=False)
        evicted = self.key_of[block] is not None
        if evicted:
            del self.by_key[self.key_of[block]]
        self.key_of[block], self.by_key[key] = key, block
        self.refs[block] = 1
        return block, evicted


def pool_like(cache: KVCache, num_blocks: int, block_size: int) -> KVCache:
    """Zero blocks in cache's layout and dtype: num_blocks rows of block_size slots (cache may be abstract)."""
    def blocks(x):
        shape = (*x.shape[:-4], num_blocks, block_size, *x.shape[-2:])
        return jnp.zeros(shape, x.dtype)

    k = tuple(map(blocks, cache.k)) if isinstance(cache.k, tuple) else blocks(cache.k)
    v = tuple(map(blocks, cache.v)) if isinstance(cache.v, tuple) else blocks(cache.v)
    return KVCache(k=k, v=v, lengths=jnp.zeros((num_blocks,), jnp.int32))


def _map_kv(fn, cache: KVCache, pool: KVCache, *args) -> tuple:
    """fn(cache leaf, pool leaf, *args) over every layer's keys and values: (new k, new v)."""
    def each(a, b):
        if isinstance(a, tuple):
            return tuple(fn(x, y, *args) for x, y in zip(a, b))
        return fn(a, b, *args)
    return each(cache.k, pool.k), each(cache.v, pool.v)


@functools.partial(jax.jit, static_argnames="block_size", donate_argnums=0)
def load_blocks(cache: KVCache, pool: KVCache, blocks, counts, rows, *, block_size: int) -> KVCache:
    """cache with row rows[i]'s slots [j * block_size, (j + 1) * block_size) set to pool block blocks[i, j], for
    j < counts[i] (the rest of the row as it was; a row past the cache's: none)."""
    def load(row_kv, pool_kv):
        def one(x, p):  # x [B, S, H, D], p [N, bs, H, D]
            batch, width = blocks.shape
            values = p[blocks].reshape(batch, width * block_size, *p.shape[2:])
            slots = jnp.arange(width * block_size)[None, :]
            slots = jnp.where(slots < counts[:, None] * block_size, slots, x.shape[1])  # past the end: dropped
            return x.at[rows[:, None], slots].set(values.astype(x.dtype), mode="drop")
        return jax.vmap(one)(row_kv, pool_kv) if row_kv.ndim == 5 else one(row_kv, pool_kv)

    k, v = _map_kv(load, cache, pool)
    return dataclasses.replace(cache, k=k, v=v)


@functools.partial(jax.jit, static_argnames="block_size", donate_argnums=0)
def store_blocks(pool: KVCache, cache: KVCache, rows, blocks, targets, *, block_size: int) -> KVCache:
    """pool with block targets[i] set to cache row rows[i]'s block blocks[i] (a target past the pool: none)."""
    def store(pool_kv, row_kv):
        def one(p, x):
            slots = blocks[:, None] * block_size + jnp.arange(block_size)[None, :]
            return p.at[targets].set(x[rows[:, None], slots].astype(p.dtype), mode="drop")
        return jax.vmap(one)(pool_kv, row_kv) if pool_kv.ndim == 5 else one(pool_kv, row_kv)

    k, v = _map_kv(store, pool, cache)
    return dataclasses.replace(pool, k=k, v=v)


class PrefixCache:
    """The pool (the target's blocks and the drafter's) with its table and counters, as the engine uses it."""

    def __init__(self, block_size: int, num_blocks: int, drop_tail: bool, max_model_len: int):
        self.block_size, self.drop_tail = block_size, drop_tail
        self.row_blocks = -(-max_model_len // block_size)  # blocks of a row at most: the copies' fixed width
        self.table = BlockTable(num_blocks)
        self.stats = PrefixStats()
        self.pools: tuple[KVCache, KVCache | None] | None = None  # made at the first admission, like its caches

    def lookup(self, prompt) -> tuple[list[bytes], list[int]]:
        """(the prompt's block keys, the pool blocks its prefill starts from, now held). The last prompt token
        is never matched: its forward draws the first token. With drop_tail the last matched block is
        recomputed (the drafter's entry at its end was written with the token that followed it then)."""
        keys = block_keys(prompt, self.block_size, len(prompt) - 1)
        blocks = self.table.match(keys)
        if self.drop_tail and blocks:
            blocks = blocks[:-1]
            self.stats.dropped_blocks += 1
        self.table.acquire(blocks)
        stats = self.stats
        stats.requests += 1
        stats.queried_tokens += len(prompt)
        stats.hit_tokens += len(blocks) * self.block_size
        stats.queried_blocks += len(keys)
        stats.hit_blocks += len(blocks)
        return keys, blocks

    def load(self, target: KVCache, draft: KVCache | None, blocks: list[list[int]], rows=None):
        """The cache rows (target, drafter's; donated) with each row's matched blocks copied in: blocks[i] into row
        rows[i] (default: row i; a row past the cache's: none)."""
        if self.pools is None:
            num = self.table.num_blocks
            self.pools = (pool_like(target, num, self.block_size),
                          None if draft is None else pool_like(draft, num, self.block_size))
        ids = np.zeros((len(blocks), self.row_blocks), np.int32)  # one shape per batch: one program
        for row, held in enumerate(blocks):
            ids[row, :len(held)] = held
        ids, counts = jnp.asarray(ids), jnp.asarray([len(held) for held in blocks], jnp.int32)
        rows = np.arange(len(blocks), dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
        target = load_blocks(target, self.pools[0], ids, counts, rows, block_size=self.block_size)
        if draft is not None:
            draft = load_blocks(draft, self.pools[1], ids, counts, rows, block_size=self.block_size)
        return target, draft

    def store(self, target: KVCache, draft: KVCache | None, rows: list[tuple[int, list[bytes], int]]) -> list[list[int]]:
        """Copies the prefilled rows' new full blocks into the pool: rows are (row, its keys, blocks it matched).
        A key the pool already holds (a batch mate stored it) is held, not stored again. Returns each row's
        newly held blocks."""
        sources, blocks, targets, held = [], [], [], []
        for row, keys, matched in rows:
            mine = []
            for index in range(matched, len(keys)):
                block = self.table.by_key.get(keys[index])
                if block is not None:
                    self.table.acquire([block])
                else:
                    block, evicted = self.table.allocate(keys[index])
                    if block is None:
                        self.stats.full_pool += len(keys) - index
                        break
                    self.stats.evicted_blocks += evicted
                    self.stats.stored_blocks += 1
                    sources.append(row), blocks.append(index), targets.append(block)
                mine.append(block)
            held.append(mine)
        if sources:
            self.copy_in(target, draft, sources, blocks, targets)
        return held

    def copy_in(self, target: KVCache, draft: KVCache | None, sources: list, blocks: list, targets: list) -> None:
        """Block blocks[i] of row sources[i] into pool block targets[i], padded to one shape per batch (one
        program each: a target past the pool copies nothing)."""
        pad = target.lengths.shape[0] * self.row_blocks - len(sources)
        args = [jnp.asarray(x + [fill] * pad, jnp.int32)
                for x, fill in ((sources, 0), (blocks, 0), (targets, self.table.num_blocks))]
        pool_target = store_blocks(self.pools[0], target, *args, block_size=self.block_size)
        pool_draft = None if draft is None else store_blocks(self.pools[1], draft, *args, block_size=self.block_size)
        self.pools = (pool_target, pool_draft)

    def release(self, blocks: list[int]) -> None:
        self.table.release(blocks)
