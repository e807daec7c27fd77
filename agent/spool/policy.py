"""How sure the model was of a sample, and which sample the spool gives up first.

The confidences come from the logits the application passes with each sample: the spool
keeps the samples the model was least sure of (hard examples) when it must drop some.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np

HardExample = Literal["margin", "entropy", "none"]


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def scores(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(margin, entropy)`` per row of ``probs`` (N, K). The margin is the probability of the
    label (of the top class where ``labels`` is -1) minus the best other class's, in [-1, 1]:
    a confidently wrong prediction scores below every right one. Entropy is in nats."""
    n = len(probs)
    rows = np.arange(n)
    target = np.where(labels >= 0, labels, probs.argmax(axis=1))
    p_target = probs[rows, target]
    others = probs.copy()
    others[rows, target] = -np.inf
    margin = p_target - others.max(axis=1)
    entropy = -(probs * np.log(np.clip(probs, 1e-12, None))).sum(axis=1)
    return margin.astype(np.float64), entropy.astype(np.float64)


def confidence(rule: HardExample, margin: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    """Higher = the model was surer = evicted sooner. NaN scores (no logits) count as the
    most confident: only a sample the model scored can claim to be hard."""
    if rule == "none":
        return np.zeros(len(margin))
    c = margin.astype(np.float64) if rule == "margin" else -entropy.astype(np.float64)
    c[np.isnan(c)] = np.inf
    return c


def eviction_order(conf: np.ndarray, t: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """Indices in the order they are evicted: the most confident first, among equals the
    oldest (recording time ``t``), then ``tie`` (recording order)."""
    return np.lexsort((tie, t, -conf))


def evictions(conf: np.ndarray, t: np.ndarray, tie: np.ndarray, first: int) -> Iterator[int]:
    """:func:`eviction_order`, lazily: a record at the quota evicts a few samples of
    thousands, so only those at least as confident as the ``first``-th are sorted (they are
    the order's head, ties included); the rest is sorted only if the caller reads on."""
    n = len(conf)
    if first >= n // 4:
        yield from eviction_order(conf, t, tie).tolist()
        return
    neg = -conf
    head = np.flatnonzero(neg <= np.partition(neg, first)[first])
    yield from head[eviction_order(conf[head], t[head], tie[head])].tolist()
    if len(head) < n:
        yield from eviction_order(conf, t, tie)[len(head):].tolist()
