"""Where each neuron's bundle goes in its layer's region of ffn.bin, from which neurons fire together.

A q4 bundle of a 7B layer is ~7-9 KiB, where the disk is IOPS-bound: a token's active set read one bundle per request
costs ~1100 requests per layer. Neurons that are often active together, stored next to each other, turn those into
fewer, longer reads (Ripple, Alizadeh et al. "LLM in a flash" also bundle by co-activation).

coactivation_order (as Ripple, greedily): score every pair of neurons by how often they fire together on calibration
text (Jaccard: tokens on which both fire / tokens on which either fires; it chained better than raw counts on a
validation split of SmolLM2's calibration text, bench/README.md); walk the pairs from the most co-active down and join two neurons whenever both are still the end of their
chain (and in different chains), so the most co-active pairs end up adjacent; lay the chains out one after another,
the chains with the most activity first. The hottest neurons (pinned in DRAM by the cache anyway) go first, by
frequency, and are left out of the chaining.
"""
from __future__ import annotations

import numpy as np

NEIGHBOURS = 32          # strongest co-activation partners kept per neuron (the pair list stays n x k, not n x n)
BLOCK = 1024             # neurons per block of the co-activation product (memory: BLOCK x n counts)


def frequency_order(active: np.ndarray) -> np.ndarray:
    """Bundle index -> neuron id, hottest first. active: bool [T, n]."""
    return np.argsort(-active.mean(axis=0), kind="stable").astype(np.int64)


def top_partners(active: np.ndarray, k: int = NEIGHBOURS, score: str = "jaccard") -> tuple[np.ndarray, np.ndarray]:
    """(partner ids int64 [n, k], scores float32 [n, k]) of each neuron's k most co-active others. score "count":
    tokens on which both fire; "jaccard": that over the tokens on which either fires (rare pairs count as much)."""
    a = np.ascontiguousarray(active, dtype=np.float32)            # [T, n]
    n = a.shape[1]
    fires = a.sum(axis=0)
    k = min(k, n - 1)
    ids = np.empty((n, k), np.int64)
    counts = np.empty((n, k), np.float32)
    for lo in range(0, n, BLOCK):
        c = a[:, lo:lo + BLOCK].T @ a                              # [b, n] co-activation counts
        if score == "jaccard":
            c /= np.maximum(fires[lo:lo + BLOCK, None] + fires[None, :] - c, 1)
        c[np.arange(c.shape[0]), np.arange(lo, lo + c.shape[0])] = -1   # not its own partner
        part = np.argpartition(-c, k - 1, axis=1)[:, :k]
        ids[lo:lo + BLOCK] = part
        counts[lo:lo + BLOCK] = np.take_along_axis(c, part, axis=1)
    return ids, counts


def chain(n: int, i: np.ndarray, j: np.ndarray, w: np.ndarray) -> list[list[int]]:
    """Greedy path cover: edges (i, j) by weight w, heaviest first, joined when both ends are chain ends of different
    chains. Returns the chains (every node in exactly one)."""
    root = np.arange(n)

    def find(x):
        while root[x] != x:
            root[x] = root[root[x]]
            x = root[x]
        return x

    nbr = [[] for _ in range(n)]
    for e in np.argsort(-w, kind="stable").tolist():
        a, b = int(i[e]), int(j[e])
        if w[e] <= 0 or len(nbr[a]) == 2 or len(nbr[b]) == 2:
            continue
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        root[ra] = rb
        nbr[a].append(b)
        nbr[b].append(a)
    chains, seen = [], np.zeros(n, bool)
    for s in range(n):
        if seen[s] or len(nbr[s]) == 2:
            continue                                  # start walks at chain ends (or lone nodes)
        path, prev, cur = [], -1, s
        while cur != -1:
            path.append(cur)
            seen[cur] = True
            nxt = [x for x in nbr[cur] if x != prev]
            prev, cur = cur, (nxt[0] if nxt else -1)
        chains.append(path)
    return chains


def coactivation_order(active: np.ndarray, hot: int = 0, k: int = NEIGHBOURS, score: str = "jaccard") -> np.ndarray:
    """Bundle index -> neuron id: the `hot` most frequent neurons first, then the rest in co-activation chains.
    active: bool [T, n] on calibration text."""
    freq = active.mean(axis=0)
    by_freq = np.argsort(-freq, kind="stable")
    hot_ids, rest = by_freq[:hot], np.sort(by_freq[hot:])
    ids, counts = top_partners(active[:, rest], k, score)
    src = np.repeat(np.arange(rest.size), ids.shape[1])
    chains = chain(rest.size, src, ids.ravel(), counts.ravel())
    chains.sort(key=lambda c: -freq[rest[c]].sum())
    order = np.concatenate([hot_ids] + [rest[c] for c in chains]).astype(np.int64)
    assert np.array_equal(np.sort(order), np.arange(active.shape[1]))
    return order
