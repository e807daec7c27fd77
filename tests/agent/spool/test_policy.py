"""Which sample the spool gives up first: the scores, and the partial sort that equals the
full one."""

from __future__ import annotations

import numpy as np

from agent.spool.policy import confidence, eviction_order, evictions, scores, softmax


def test_margin_uses_the_label_entropy_does_not() -> None:
    probs = softmax(np.array([[4.0, 0.0, 0.0], [4.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    margin, entropy = scores(probs, np.array([0, 1, -1]))
    assert margin[0] > 0.9 and margin[1] < -0.9  # right and sure; wrong and sure
    assert abs(margin[2]) < 1e-12 and entropy[2] == max(entropy)  # a coin toss
    assert entropy[0] == entropy[1]
    conf = confidence("margin", margin, entropy)
    assert eviction_order(conf, np.zeros(3), np.arange(3)).tolist() == [0, 2, 1]
    none = confidence("entropy", np.array([np.nan]), np.array([np.nan]))
    assert none[0] == np.inf  # no logits: the first to go


def test_the_lazy_order_is_the_full_order() -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 400))
        conf = rng.integers(0, 5, n).astype(float) if trial % 2 else rng.normal(size=n)
        conf[rng.random(n) < 0.1] = np.inf
        t = rng.integers(0, 3, n).astype(float)
        first = int(rng.integers(0, n))
        assert list(evictions(conf, t, np.arange(n), first)) == \
            eviction_order(conf, t, np.arange(n)).tolist()
