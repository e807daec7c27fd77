"""What benchmarks/federated_protocol.py's figures rest on: the vectorized devices train as
torch.optim.SGD does on each device alone (FedProx's term as the trainer adds it), a run's
figures do not depend on the runs beside it, and the attacks are what the papers define."""

from __future__ import annotations

import argparse
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from benchmarks.federated_protocol import (
    Lanes,
    Late,
    Optim,
    Run,
    _federated,
    _fill,
    alie_z,
    attack,
    flat,
    hold_out,
    init_params,
    make_fleet,
    make_model,
    parse,
    personalize,
    round_updates,
    straggler_jobs,
    unflat_lanes,
)
from hpc_core.aggregation.in_memory import Rule, combine_updates

HIDDEN = (12,)
OPTIM = Optim(lr=0.05, momentum=0.9, weight_decay=1e-3)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _reference(x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, seed: int, mu: float,
               epochs: int, batch: int) -> torch.Tensor:
    """One device alone: the model, torch.optim.SGD, the trainer's proximal gradient."""
    torch.manual_seed(seed)
    model = make_model(HIDDEN)
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=OPTIM.lr, momentum=OPTIM.momentum,
                          weight_decay=OPTIM.weight_decay)
    for e in range(epochs):
        for first in range(0, len(y), batch):
            idx = order[e][first:first + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            with torch.no_grad():  # hpc_core.trainer's _proximal_gradient
                for p, p0 in zip(model.parameters(), anchor, strict=True):
                    p.grad.add_(p.detach() - p0, alpha=mu)
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_lanes_train_as_sgd_on_each_device_alone(mu: float) -> None:
    sizes, seeds, batch, epochs = (70, 150, 9), (3, 4, 5), 32, 2
    data = [_data(n, s) for n, s in zip(sizes, seeds, strict=True)]
    model = make_model(HIDDEN)
    lanes = Lanes(model, data, batch, OPTIM,
                  [(torch.Generator().manual_seed(s), 1) for s in seeds])
    # the batch order each lane draws, read from twin generators
    twins = Lanes(model, data, batch, OPTIM,
                  [(torch.Generator().manual_seed(s), 1) for s in seeds])
    orders = [twins._order() for _ in range(epochs)]
    init = [init_params(HIDDEN, s) for s in seeds]
    rows = torch.stack([flat(p, 1)[0] for p in init])
    like = init[0]
    params = {k: v.clone() for k, v in unflat_lanes(rows, like).items()}
    anchor = unflat_lanes(rows, like)
    buf = {k: torch.zeros_like(v) for k, v in params.items()}
    for _ in range(epochs):
        lanes.epoch(params, buf, anchor, torch.full((3,), mu))
    got = flat(params, 3)
    for i, ((x, y), n, s) in enumerate(zip(data, sizes, seeds, strict=True)):
        want = _reference(x, y, [o[i, :n] for o in orders], s, mu, epochs, batch)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)


def test_a_lane_trains_the_same_whatever_lanes_beside_it() -> None:
    data = [_data(40, 1), _data(100, 2)]
    model = make_model(HIDDEN)

    def train(which: list[int]) -> torch.Tensor:
        chosen = [data[i] for i in which]
        lanes = Lanes(model, chosen, 16, OPTIM,
                      [(torch.Generator().manual_seed(i), 1) for i in which])
        rows = torch.stack([flat(init_params(HIDDEN, 0), 1)[0] for _ in which])
        like = init_params(HIDDEN, 0)
        params = {k: v.clone() for k, v in unflat_lanes(rows, like).items()}
        buf = {k: torch.zeros_like(v) for k, v in params.items()}
        lanes.epoch(params, buf, None, torch.zeros(len(which)))
        return flat(params, len(which))

    torch.testing.assert_close(train([0, 1])[0], train([0])[0])
    torch.testing.assert_close(train([0, 1])[1], train([1])[0])


def test_alie_z_is_the_papers_formula() -> None:
    # Baruch et al. 2019: s = floor(n / 2 + 1) - m, z = Phi^-1((n - s) / n)
    assert alie_z(10, 2) == pytest.approx(stats.norm.ppf(0.6))  # s = 4
    assert alie_z(10, 2) == pytest.approx(0.2533, abs=1e-4)
    assert alie_z(50, 12) == pytest.approx(stats.norm.ppf(36 / 50))  # s = 14


def test_attacks_replace_only_the_attackers_uploads() -> None:
    rng = np.random.default_rng(0)
    honest = rng.normal(size=(8, 5)).astype(np.float32)
    deltas = np.concatenate([honest, rng.normal(size=(2, 5)).astype(np.float32)])
    for kind, want in [("scale", deltas[8:] * 50), ("flip", deltas[8:] * -50),
                       ("alie", np.tile(honest.mean(0) - alie_z(10, 2) * honest.std(0),
                                        (2, 1)))]:
        out = attack(deltas, kind, 2, 50.0)
        np.testing.assert_allclose(out[:8], honest)
        np.testing.assert_allclose(out[8:], want, rtol=1e-6)
    assert attack(deltas, "none", 2, 50.0) is deltas


def test_bad_arguments_are_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fix in [(["--partitions", "dirichlet:0"], "alpha must be > 0"),
                      (["--rules", "fedavg,krumm"], "a comma list of fedavg"),
                      (["--attackers", "10"], "fewer than --devices 10"),
                      (["--hidden", "a"], "comma list of widths"),
                      (["--straggler-slowdown", "1/2"], "a number >= 1"),
                      (["--stragglers", "10"], "fewer than --devices 10")]:
        with pytest.raises(SystemExit):
            parse(argv)
        assert fix in capsys.readouterr().err
    assert isinstance(parse(["--rounds", "120"]), argparse.Namespace)  # no cap on rounds


def test_a_straggler_lands_in_the_round_that_closes_after_its_fine_tune() -> None:
    # round k runs from k - 1 to k; a job starts from the release current when it starts
    assert straggler_jobs(6, Fraction(1)) == [(k, k) for k in range(1, 7)]
    assert straggler_jobs(6, Fraction(2)) == [(1, 2), (3, 4), (5, 6)]
    assert straggler_jobs(6, Fraction(3, 2)) == [(1, 2), (2, 3), (4, 5), (5, 6)]
    assert straggler_jobs(6, Fraction(5, 2)) == [(1, 3), (3, 5)]
    assert straggler_jobs(1, Fraction(2)) == []  # it would land after the last round
    with pytest.raises(ValueError, match="at least one round"):
        straggler_jobs(6, Fraction(1, 2))


def test_a_late_update_counts_in_the_next_round_with_the_products_discount() -> None:
    # 4 devices, the last one straggling (its fine-tune lands one round later)
    samples = [10.0, 30.0, 20.0, 40.0]
    first = np.arange(16, dtype=np.float32).reshape(4, 4)
    second = -np.ones((4, 4), dtype=np.float32)
    jobs = dict(straggler_jobs(2, Fraction(2)))
    flight: list[Late] = []
    rows, counts, stale = round_updates(1, first, samples, 1, jobs, flight, 2)
    np.testing.assert_array_equal(rows, first[:3])  # round 1 closes at its quorum of 3
    assert counts == samples[:3] and stale == [0, 0, 0] and len(flight) == 1
    rows, counts, stale = round_updates(2, second, samples, 1, jobs, flight, 2)
    # the straggler's round-1 delta (from round 1's base), one release stale
    np.testing.assert_array_equal(rows, np.concatenate([second[:3], first[3:]]))
    assert counts == samples and stale == [0, 0, 0, 1] and flight == []
    got = combine_updates(rows, counts, Rule(), staleness=stale)
    w = np.array(samples) / sum(samples)
    want = w[:3] @ second[:3] + w[3] * first[3] / np.sqrt(2)  # FedBuff: 1 / (1 + 1) ** 0.5
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # with --max-staleness 0 (the product's default) it is dropped for good
    flight = []
    round_updates(1, first, samples, 1, jobs, flight, 0)
    rows, counts, stale = round_updates(2, second, samples, 1, jobs, flight, 0)
    np.testing.assert_array_equal(rows, second[:3])
    assert stale == [0, 0, 0] and flight == []


def test_a_head_fine_tune_trains_the_last_layer_alone() -> None:
    data = [_data(50, 1), _data(30, 2)]
    model = make_model(HIDDEN)
    like = init_params(HIDDEN, 0)
    head = list(like)[-2:]
    lanes = Lanes(model, data, 16, OPTIM, [(torch.Generator().manual_seed(0), 2)],
                  frozen=[k for k in like if k not in head])
    rows = torch.stack([flat(like, 1)[0]] * 2)
    params = {k: v.clone() for k, v in unflat_lanes(rows, like).items()}
    buf = {k: torch.zeros_like(v) for k, v in params.items()}
    lanes.epoch(params, buf, None, torch.zeros(2))
    for k, v in params.items():
        moved = not torch.equal(v, unflat_lanes(rows, like)[k])
        assert moved == (k in head), k


def test_each_device_holds_out_part_of_its_own_data() -> None:
    fleet = make_fleet("dirichlet:0.5+cameras:plain,invert", 0, 4, 0.2)
    held = hold_out(fleet, 0.2)
    for x, y, tx, ty, ox, oy, vx, vy in zip(fleet.x, fleet.y, held.x, held.y, held.own_x,
                                            held.own_y, held.val_x, held.val_y, strict=True):
        # a test part and a validation part of the same size, the rest to train on
        assert len(ty) + len(oy) + len(vy) == len(y) and len(vy) == len(oy)
        assert 1 <= len(oy) <= max(1, round(0.2 * len(y)))
        # the same samples, as the device's camera sees them, split without overlap
        parts = torch.cat([tx, ox, vx]).reshape(len(y), -1)
        mine = x.reshape(len(y), -1)
        assert sorted(map(tuple, parts.tolist())) == sorted(map(tuple, mine.tolist()))
        assert sorted(torch.cat([ty, oy, vy]).tolist()) == sorted(y.tolist())
    assert held.test_x is fleet.test_x


def test_a_device_serves_the_model_best_on_its_validation_data() -> None:
    """Personalization: the whole fine-tune keeps its best epoch on validation, the global
    model as it came among them, and the served model is the best on validation."""
    args = parse(["--quick", "--devices", "4", "--rounds", "2", "--ft-epochs", "6"])
    fleet = hold_out(make_fleet("cameras:plain,invert", 0, 4, 0.2), 0.2)
    run = Run(fleet, "fedavg", Rule(), 0.0, attack="personal")
    _fill([run], _federated([run], args))  # the fedavg run, in this process
    [result] = personalize([run], args)
    for d in result["devices"]:
        v = d["val"]
        assert v["ft"] >= v["global"]  # epoch 0 is one of the whole fine-tune's choices
        assert v[d["served_by"]] == max(v["ft"], v["head"], v["local"])
        assert d["served"] == d[d["served_by"]]
