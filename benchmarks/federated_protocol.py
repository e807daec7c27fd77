"""Fleet learning measured the way the field measures it: NIID-Bench's protocol (Li et al.
2022, as Flower's baselines reproduce it) on the digits, with the project's own aggregation
rules, under attack, several seeds, beside a centralized bound.

* **Protocol.** 10 devices (``--devices``, any count), 50 rounds (``--rounds``, no cap), 10
  local epochs a round (``--local-epochs``); every device takes part in every round and starts
  it from the global model with a fresh optimizer: SGD, learning rate 0.01, momentum 0.9,
  batch 64, weight decay 1e-5 (NIID-Bench's settings). Partitions (``--partitions``, specs of
  :mod:`hpc_core.partitions`): ``iid``, ``dirichlet:0.5`` (label skew), ``labels:2`` (two
  classes a device) and ``dirichlet:0.5+cameras:plain,invert,rotate`` (label and feature
  skew). Data: sklearn's 1,797 digits (8 x 8, nothing downloaded), a seeded 20 % held out
  as the test set nobody trains on; the rest dealt out to the devices.
* **Model.** ``hpc_core.models``' ``mlp``, 64-128-64-10 with ReLUs (``--hidden``; McMahan
  et al. 2017's "MNIST 2NN", ``--hidden 200,200``, costs ~3x the time for the same
  accuracy here), built by ``build_model`` and run through ``torch.func``.
* **Rules** (``--rules``): each round's device deltas are combined by
  ``hpc_core.aggregation.in_memory.combine_updates``: ``hpc-train aggregate``'s own clip,
  weights, Krum choice, ``strategies.combine_block``, DP noise and server step, on the deltas
  held in memory (its tests check it equals ``run_round`` on a registry). ``fedavg`` (weighted
  by sample count), ``fedprox`` (fedavg of devices training with the trainer's
  ``training.proximal_mu`` term, mu * (w - w_global) added to the gradient), ``trimmed-mean``
  (0.2 a side), ``median``, ``krum`` and ``multi-krum`` (f = the attackers, keeping N - f),
  ``fedavg+clip`` (each update clipped to the round's median norm, ``--clip-norm median``),
  ``dp-fedavg`` (central DP, fixed denominator, ``--dp-epsilon`` over the rounds; off unless
  named).
* **Centralized bound.** The same model and optimizer on the union of the devices' data (each
  sample as its device's camera sees it) for rounds x local epochs epochs, batch 64: as many
  sample gradients as the whole fleet computes. Its accuracy at the last round is the bound;
  "round to 95 %" is the first round whose accuracy (mean over seeds) reaches 0.95 x it.
* **Attacks** (on ``--attack-partition``, the last ``--attackers`` devices, 2 of 10): each
  trains honestly, then uploads ``scale`` (delta x 50), ``flip`` (delta x -50, as
  ``benchmarks/federated.py``) or ``alie`` (Baruch et al. 2019, "A little is enough": every
  attacker sends mean - z * std per coordinate of the honest deltas, z = Phi^-1((n - s) / n),
  s = floor(n / 2 + 1) - m: 0.253 for n = 10, m = 2).
* **Seeds** (``--seeds``): the test split, the partition, the initial model and the batch
  order; figures are the mean over seeds +- their standard deviation.
* **Stragglers** (``--stragglers``, the last 2 devices, on ``--straggler-partition``,
  fedavg): a round closes at its quorum, the on-time devices (their fine-tune takes one unit
  of simulated time); a straggler's takes ``--straggler-slowdown`` units (2), so it lands in
  a later round, trained from an older base: combined there with ``hpc-train aggregate``'s
  FedBuff discount (``combine_updates``' ``staleness``, up to ``--max-staleness``), or
  dropped (``max_staleness`` 0). Beside every device on time, which is also what waiting for
  everyone gets by round, at ``slowdown`` units a round.
* **Personalization** (``--personal``: the camera mix with label skew, and alone): fedavg
  with ``--personal-holdout`` (20 %) of each device's own data held out as its test set and
  as much as its validation set; each device scored by its local-only model (its data alone,
  the same epochs, its best checkpoint on validation), the global model, the global model
  with its last layer fine-tuned on the device's data (``--head-epochs``), the global model
  fine-tuned whole (``--ft-epochs``, its best epoch on validation), and the model it serves:
  the best of those on its validation data, as its health check keeps the better of two
  models; the union of the held-out parts by the global model and every local-only one.
  FedBN is not simulated: the mlp has no normalization layer.

What is simulated and what is the product path: the devices' local training is simulated,
all in this one process, vectorized over devices and runs: ``torch.func.vmap`` of
``grad(functional_call(model, ...))`` over stacked per-device weights, one batch of every
active device at a time (a device with more data takes more steps; an epoch is a pass over
its own data), with SGD written out on the stacked tensors. On a real fleet each device runs
``agent.finetune.recipe.run_finetune`` (the trainer, its optimizer and pacing) and uploads a
signed checkpoint to the registry; ``hpc-train aggregate`` verifies, streams and combines
them (``benchmarks/federated.py`` runs that whole path, 8 devices, a few rounds). Here only
the combination is the product's code; no registry, signing, transport or device recipe is
exercised.

Printed: the host's CPU (AVX2 / AVX-512 VNNI flags), per partition and rule the final
accuracy (mean +- sd over seeds), its ratio to the centralized bound and the round it reached
0.95 x that bound, each rule under each attack beside clean fedavg, the wall time, then the
targets (fedavg on dirichlet:0.5 >= 0.95 x centralized by round 50, iid and labels:2 beside
it; some shipped rule within 2 points of clean fedavg under ALIE) and the verdict line.

    python benchmarks/federated_protocol.py --json fp.json --plot fp.png   # the full run
    python benchmarks/federated_protocol.py --rules fedavg,median --partitions iid \\
        --seeds 1 --attacks alie                                           # one partition
    python benchmarks/federated_protocol.py --rounds 100 --devices 20      # longer, wider
    python benchmarks/federated_protocol.py --quick     # 3 devices, 2 rounds: it runs
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import cpu_line, parse_args, verdict  # noqa: E402
from hpc_core.aggregation.in_memory import Rule, combine_updates  # noqa: E402
from hpc_core.aggregation.privacy import DpSettings, epsilon  # noqa: E402
from hpc_core.aggregation.strategies import staleness_scale  # noqa: E402
from hpc_core.data import load_digits_tensors  # noqa: E402
from hpc_core.models import build_model  # noqa: E402
from hpc_core.partitions import PartitionError, Shard, device_data, parse_spec, split  # noqa: E402

HEADLINE = "dirichlet:0.5"
PERSONAL = ("dirichlet:0.5+cameras:plain,invert,rotate,noise", "cameras:plain,invert,rotate,noise")
"""Personalization: sites that see different classes through different cameras (label and
feature skew), and the camera mix alone (feature skew)."""
BESIDE = ("iid", "labels:2")
DEFAULT_PARTITIONS = ("iid", "dirichlet:0.5", "labels:2",
                      "dirichlet:0.5+cameras:plain,invert,rotate")
ALL_RULES = ("fedavg", "fedprox", "trimmed-mean", "median", "krum", "multi-krum",
             "fedavg+clip", "dp-fedavg")
DEFAULT_RULES = ("fedavg", "fedprox", "trimmed-mean", "median", "krum", "multi-krum",
                 "fedavg+clip")
ATTACKS = ("scale", "flip", "alie")
TARGET_RATIO = 0.95
"""federated / centralized accuracy by round 50 (headline and the partitions beside it)."""
TARGET_BY_ROUND = 50
ALIE_POINTS = 2.0
"""Some shipped rule under ALIE within this many points of clean fedavg."""
IMAGE_SIZE = 8  # the digits' own resolution: upsampling adds pixels, not information
LATE = {"stragglers": "late updates discounted", "stragglers-dropped": "late updates dropped"}
"""Straggler runs (in the attack slot of a run's key): late updates combined in the round they
arrive in with the FedBuff discount (``--max-staleness``), or dropped (the product's default,
``max_staleness`` 0)."""


# --- data ----------------------------------------------------------------------------------

@dataclass
class Fleet:
    """One partition of one seed: the devices' data (through their cameras) and the test
    set (through every camera of the partition, equal parts)."""

    spec: str
    seed: int
    shards: list[Shard]
    x: list[torch.Tensor]
    y: list[torch.Tensor]
    test_x: torch.Tensor
    test_y: torch.Tensor
    own_x: list[torch.Tensor] = field(default_factory=list)
    """Per device, its own held-out data (personalization runs only; see ``hold_out``)."""
    own_y: list[torch.Tensor] = field(default_factory=list)
    val_x: list[torch.Tensor] = field(default_factory=list)
    """Per device, its own validation data: what it chooses the model it serves by (its
    health check's held-out data), never trained on and never scored."""
    val_y: list[torch.Tensor] = field(default_factory=list)

    @property
    def samples(self) -> list[int]:
        return [len(t) for t in self.y]


def hold_out(fleet: Fleet, fraction: float) -> Fleet:
    """The fleet with a seeded ``fraction`` of each device's own data (its classes, through
    its camera) held out as that device's test set and as much again as its validation set
    (at least one sample each), the rest to train on: the protocol of personalized FL
    benchmarks (a device is scored on what it sees), with the device's own choice of model
    made on data apart from both."""
    xs, ys, ox, oy, vx, vy = [], [], [], [], [], []
    for i, (x, y) in enumerate(zip(fleet.x, fleet.y, strict=True)):
        perm = torch.from_numpy(np.random.default_rng(fleet.seed * 1000 + 900 + i)
                                .permutation(len(y)))
        k = min(max(1, round(fraction * len(y))), (len(y) - 1) // 2)
        ox.append(x[perm[:k]])
        oy.append(y[perm[:k]])
        vx.append(x[perm[k:2 * k]])
        vy.append(y[perm[k:2 * k]])
        xs.append(x[perm[2 * k:]])
        ys.append(y[perm[2 * k:]])
    return Fleet(fleet.spec, fleet.seed, fleet.shards, xs, ys, fleet.test_x, fleet.test_y, ox, oy,
                 vx, vy)


def make_fleet(spec: str, seed: int, devices: int, test_fraction: float) -> Fleet:
    x, y = load_digits_tensors(IMAGE_SIZE)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = round(test_fraction * len(y))
    test, pool = perm[:n_test], perm[n_test:]
    parsed = parse_spec(spec)
    shards = split(parsed, y[pool].numpy(), devices, seed=seed)
    xs, ys = [], []
    for i, s in enumerate(shards):
        dx, dy = device_data(x[pool], y[pool], s, seed=seed * 1000 + i)
        xs.append(dx)
        ys.append(dy)
    cams = parsed.cameras or ((),)
    tx = torch.cat([device_data(x[test], y[test], Shard(np.arange(len(test)), c),
                                seed=seed * 1000 + 500 + j)[0] for j, c in enumerate(cams)])
    ty = y[test].repeat(len(cams))
    return Fleet(spec, seed, shards, xs, ys, tx, ty)


# --- the model, functionally ----------------------------------------------------------------

def make_model(hidden: Sequence[int]) -> torch.nn.Module:
    return build_model("mlp", num_classes=10, in_channels=1, image_size=IMAGE_SIZE,
                       hidden=tuple(hidden))


def init_params(hidden: Sequence[int], seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in make_model(hidden).named_parameters()}


def flat(params: dict[str, torch.Tensor], lanes: int) -> torch.Tensor:
    """lanes x D: each lane's weights in one row."""
    return torch.cat([v.reshape(lanes, -1) for v in params.values()], dim=1)


def unflat(row: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for k, v in like.items():
        out[k] = row[at:at + v.numel()].reshape(v.shape)
        at += v.numel()
    return out


@dataclass
class Optim:
    """SGD with momentum and weight decay (torch.optim.SGD's step, written out on stacked
    weights so that one call steps every lane)."""

    lr: float
    momentum: float
    weight_decay: float


class Lanes:
    """Stacked weights of L simulated devices (or centralized runs), each with its own data
    in a shared pool, trained together: one vmapped gradient a step over the lanes that still
    have a batch in this epoch.

    Lanes come in groups (a run's devices), each group drawing its batch order from its own
    generator, so a run's figures do not depend on which other runs share its lanes."""

    def __init__(self, model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                 batch: int, optim: Optim, groups: list[tuple[torch.Generator, int]],
                 frozen: Sequence[str] = ()) -> None:
        if sum(n for _, n in groups) != len(data):
            raise ValueError("groups must cover the lanes")
        self.model, self.batch, self.optim, self.groups = model, batch, optim, groups
        self.frozen = frozenset(frozen)
        """Weights left as they are (a head fine-tune trains the last layer alone)."""
        self.pool_x = torch.cat([x for x, _ in data])
        self.pool_y = torch.cat([y for _, y in data])
        self.count = torch.tensor([len(y) for _, y in data])
        self.start = torch.cumsum(self.count, 0) - self.count
        self.grad = vmap(grad(self._loss))

    def _loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
              w: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, params, (x,))
        per = F.cross_entropy(out, y, reduction="none")
        return (per * w).sum() / w.sum().clamp(min=1.0)

    def _order(self) -> torch.Tensor:
        """Per lane, a random order of its own samples (padding sorts last)."""
        n_max = int(self.count.max())
        keys, at = [], 0
        for gen, n in self.groups:
            own = int(self.count[at:at + n].max())
            k = torch.full((n, n_max), 3.0)
            k[:, :own] = torch.rand(n, own, generator=gen)
            keys.append(k)
            at += n
        order = torch.cat(keys)
        order += (torch.arange(n_max)[None, :] >= self.count[:, None]).float() * 2
        return order.argsort(dim=1)

    def epoch(self, params: dict[str, torch.Tensor], buf: dict[str, torch.Tensor],
              anchor: dict[str, torch.Tensor] | None, mu: torch.Tensor) -> None:
        """One pass of every lane over its own data, in place: ``params`` and the momentum
        ``buf``; ``mu`` per lane, FedProx's pull towards ``anchor``."""
        order = self._order()
        lanes, o = len(self.count), self.optim
        prox = anchor is not None and bool((mu > 0).any())
        for first in range(0, order.shape[1], self.batch):
            active = torch.nonzero(self.count > first).squeeze(1)
            every = len(active) == lanes  # most steps: no gather and scatter of weights
            cols = order[active, first:first + self.batch]
            take = (first + torch.arange(cols.shape[1]))[None, :] < self.count[active, None]
            idx = torch.where(take, self.start[active, None] + cols, 0)
            p = params if every else {k: v[active] for k, v in params.items()}
            g = self.grad(p, self.pool_x[idx], self.pool_y[idx], take.float())
            m = mu if every else mu[active]
            for k, pk in p.items():
                if k in self.frozen:
                    continue
                gk = g[k].add_(pk, alpha=o.weight_decay)
                if prox:
                    a = anchor[k] if every else anchor[k][active]  # type: ignore[index]
                    gk += m.view(-1, *[1] * (pk.dim() - 1)) * (pk - a)
                if every:
                    buf[k].mul_(o.momentum).add_(gk)
                    pk.sub_(buf[k], alpha=o.lr)
                else:
                    bk = buf[k][active].mul_(o.momentum).add_(gk)
                    buf[k].index_copy_(0, active, bk)
                    params[k].index_copy_(0, active, pk - o.lr * bk)


def accuracy(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
             y: torch.Tensor) -> float:
    with torch.no_grad():
        out = functional_call(model, params, (x,))
    ok = torch.isfinite(out).all(1) & (out.argmax(1) == y)  # non-finite outputs count wrong
    return float(ok.float().mean())


# --- rules and attacks ------------------------------------------------------------------------

def alie_z(n: int, m: int) -> float:
    """Baruch et al. 2019: z_max = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - m, the
    attackers' supporters needed for a majority."""
    s = math.floor(n / 2 + 1) - m
    return statistics.NormalDist().inv_cdf((n - s) / n)


def attack(deltas: np.ndarray, kind: str, attackers: int, scale: float) -> np.ndarray:
    """The round's uploads when the last ``attackers`` rows are poisoned with ``kind``."""
    if kind == "none" or attackers == 0:
        return deltas
    out = deltas.copy()
    bad = slice(len(deltas) - attackers, None)
    if kind == "scale":
        out[bad] *= scale
    elif kind == "flip":
        out[bad] *= -scale
    else:  # alie: inside the honest spread, every attacker the same vector
        honest = deltas[: len(deltas) - attackers]
        z = alie_z(len(deltas), attackers)
        out[bad] = honest.mean(0) - z * honest.std(0)
    return out


@functools.cache
def dp_noise_multiplier(target_eps: float, delta: float, rounds: int) -> float:
    """The smallest noise multiplier (to 0.1 %) whose epsilon after ``rounds`` is within
    ``target_eps`` (the aggregation's own accountant)."""
    lo, hi = 0.05, 1000.0
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if epsilon(mid, delta, rounds) <= target_eps else (mid, hi)
    return hi


def rule_for(name: str, args: argparse.Namespace) -> tuple[Rule, float]:
    """The aggregation rule and the devices' proximal mu of a ``--rules`` name."""
    f = max(args.attackers, 1)
    if name == "dp-fedavg":
        z = dp_noise_multiplier(args.dp_epsilon, args.dp_delta, args.rounds)
        dp = DpSettings(noise_multiplier=z, delta=args.dp_delta, rounds=args.rounds,
                        clip_norm=args.dp_clip, expected_weight=float(args.devices))
        return Rule(clip_norm=args.dp_clip, dp=dp), 0.0
    return {
        "fedavg": (Rule(), 0.0),
        "fedprox": (Rule(), args.prox_mu),
        "trimmed-mean": (Rule("trimmed-mean", trim=args.trim), 0.0),
        "median": (Rule("median"), 0.0),
        "krum": (Rule("krum", krum_f=f), 0.0),
        "multi-krum": (Rule("krum", krum_f=f, krum_keep=args.devices - f), 0.0),
        "fedavg+clip": (Rule(clip_norm="median"), 0.0),
    }[name]


def runnable(name: str, args: argparse.Namespace) -> bool:
    """Krum needs N >= 2f + 3 (and Multi-Krum N - f >= 1)."""
    if name in ("krum", "multi-krum"):
        return args.devices >= 2 * max(args.attackers, 1) + 3
    return True


# --- stragglers -------------------------------------------------------------------------------

def straggler_jobs(rounds: int, slowdown: Fraction) -> list[tuple[int, int]]:
    """One straggler's fine-tunes as (base round, round combined in), rounds 1-based.

    Simulated time: round k runs from k - 1 to k (the on-time devices' fine-tune takes one
    unit and the round closes at its quorum, when they are in). A straggler's fine-tune takes
    ``slowdown`` units; it starts from the release current when it starts (round k's base
    during (k - 1, k], the new release at k) and is combined by the first round that closes
    at or after it ends, ``round combined in - base round`` releases stale. Then it starts
    its next one. Jobs that end after the last round are left out."""
    if slowdown < 1:
        raise ValueError(f"slowdown {slowdown}: a straggler takes at least one round")
    jobs, t = [], Fraction(0)
    while True:
        base = math.floor(t) + 1
        end = t + slowdown
        combined = math.ceil(end)
        if base > rounds or combined > rounds:
            return jobs
        jobs.append((base, combined))
        t = end


@dataclass
class Late:
    """A straggler's update in flight: its delta against its own base, and when it lands."""

    delta: np.ndarray
    samples: float
    combined: int
    staleness: int


def round_updates(rnd: int, deltas: np.ndarray, samples: Sequence[float], stragglers: int,
                  jobs: dict[int, int], flight: list[Late], max_staleness: int
                  ) -> tuple[np.ndarray, list[float], list[int]]:
    """Round ``rnd``'s uploads (rows, sample counts, staleness): the on-time devices' fresh
    deltas, then the stragglers' updates that land in it within ``max_staleness`` (as
    ``fleet.learn.updates.choose_updates`` admits them; staler ones are dropped for good).
    ``deltas`` holds every device's training of this round from its base: a straggler that
    starts a fine-tune now (``jobs``: base round -> round combined in) puts it in ``flight``."""
    n = len(deltas)
    if rnd in jobs:
        flight += [Late(deltas[i].copy(), float(samples[i]), jobs[rnd], jobs[rnd] - rnd)
                   for i in range(n - stragglers, n)]
    landed = [u for u in flight if u.combined == rnd]
    flight[:] = [u for u in flight if u.combined > rnd]
    landed = [u for u in landed if u.staleness <= max_staleness]
    rows = np.concatenate([deltas[:n - stragglers], [u.delta for u in landed]]) if landed \
        else deltas[:n - stragglers]
    return (rows, [float(c) for c in samples[:n - stragglers]] + [u.samples for u in landed],
            [0] * (n - stragglers) + [u.staleness for u in landed])


# --- runs -------------------------------------------------------------------------------------

@dataclass
class Run:
    """One federated run: a partition, a seed, a rule, an attack."""

    fleet: Fleet
    rule_name: str
    rule: Rule
    mu: float
    attack: str = "none"
    """An attack of ATTACKS, or a straggler case of LATE, or "none"."""
    curve: list[float] = field(default_factory=list)
    """Test accuracy of the global model after each round (index 0: the initial model)."""
    note: str = ""
    final: torch.Tensor | None = None
    """The global model after the last round, flat."""
    stragglers: int = 0
    """The last devices finish a fine-tune ``slowdown`` round durations after they start."""
    slowdown: Fraction = Fraction(1)
    max_staleness: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.fleet.spec, self.rule_name, self.attack)


@dataclass
class Central:
    """The centralized bound on one partition's union of device data, one seed."""

    fleet: Fleet
    curve: list[float] = field(default_factory=list)


def run_all(runs: list[Run], centrals: list[Central], args: argparse.Namespace,
            progress: Callable[[str], None]) -> None:
    """The centralized runs and every federated run, ``--lanes`` devices at a time, over
    ``--workers`` processes (one torch thread each); fills in their curves."""
    per = max(1, args.lanes // args.devices)
    chunks = [runs[i:i + per] for i in range(0, len(runs), per)]
    if args.workers <= 1:
        for c, curve in zip(centrals, _centralized(centrals, args), strict=True):
            c.curve = curve
        progress("centralized done")
        for i, chunk in enumerate(chunks):
            _fill(chunk, _federated(chunk, args))
            progress(f"federated: {i + 1}/{len(chunks)} chunks of up to {per} runs done")
        return
    # spawn, not fork: a forked child of a process that has run torch may deadlock
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        central = pool.submit(_centralized, centrals, args)  # the longest single job first
        futures = {pool.submit(_federated, chunk, args): chunk for chunk in chunks}
        for done, fut in enumerate(as_completed(futures), 1):
            _fill(futures[fut], fut.result())
            progress(f"federated: {done}/{len(chunks)} chunks of up to {per} runs done")
        for c, curve in zip(centrals, central.result(), strict=True):
            c.curve = curve
        progress("centralized done")


def _fill(runs: list[Run], results: list[tuple[list[float], str, torch.Tensor]]) -> None:
    for r, (curve, note, final) in zip(runs, results, strict=True):
        r.curve, r.note, r.final = curve, note, final


def _start_process() -> None:
    # Matrices this small gain nothing from torch's threads, and on a shared host their
    # spin-waits cost 5-10x: one thread a process, a process a core.
    torch.set_num_threads(1)


def _federated(runs: list[Run], args: argparse.Namespace
               ) -> list[tuple[list[float], str, torch.Tensor]]:
    """Every run of the chunk in lock-step: (curve, note, final global weights) per run."""
    _start_process()
    n, model = args.devices, make_model(args.hidden)
    data = [(x, y) for r in runs for x, y in zip(r.fleet.x, r.fleet.y, strict=True)]
    # a run's batch order from its seed alone: the rules of one seed see the same batches
    groups = [(torch.Generator().manual_seed(r.fleet.seed), n) for r in runs]
    lanes = Lanes(model, data, args.batch, Optim(args.lr, args.momentum, args.weight_decay),
                  groups)
    init = [init_params(args.hidden, r.fleet.seed) for r in runs]
    glob = [flat(p, 1)[0] for p in init]  # each run's global weights, flat
    like = init[0]
    mu = torch.tensor([r.mu for r in runs for _ in range(n)], dtype=torch.float32)
    rngs = [np.random.default_rng(r.fleet.seed + 17) for r in runs]  # DP noise, seeded
    curves = [[accuracy(model, unflat(g, like), r.fleet.test_x, r.fleet.test_y)]
              for r, g in zip(runs, glob, strict=True)]
    notes = [""] * len(runs)
    jobs = [dict(straggler_jobs(args.rounds, r.slowdown)) if r.stragglers else {} for r in runs]
    flights: list[list[Late]] = [[] for _ in runs]
    for rnd in range(1, args.rounds + 1):
        start = torch.stack([g for g in glob for _ in range(n)])  # L x D
        params = {k: v.clone() for k, v in unflat_lanes(start, like).items()}
        anchor = unflat_lanes(start, like)
        buf = {k: torch.zeros_like(v) for k, v in params.items()}  # a fresh optimizer
        for _ in range(args.local_epochs):
            lanes.epoch(params, buf, anchor, mu)
        deltas = (flat(params, len(start)) - start).numpy()
        for j, r in enumerate(runs):
            rows = deltas[j * n:(j + 1) * n]
            samples, stale = [float(s) for s in r.fleet.samples], None
            if r.stragglers:
                rows, samples, stale = round_updates(rnd, rows, samples, r.stragglers, jobs[j],
                                                     flights[j], r.max_staleness)
            else:
                rows = attack(rows, r.attack, args.attackers, args.attack_scale)
            try:
                step = combine_updates(rows, samples, r.rule, rng=rngs[j], staleness=stale)
            except ValueError as e:  # every update non-finite: the model stays where it is
                notes[j] = notes[j] or f"round {rnd}: {e}"
                step = np.zeros(rows.shape[1])
            glob[j] = glob[j] + torch.from_numpy(step).float()
            curves[j].append(accuracy(model, unflat(glob[j], like), r.fleet.test_x,
                                      r.fleet.test_y))
    return list(zip(curves, notes, glob, strict=True))


def unflat_lanes(rows: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """L x D rows as stacked weights (L x each shape)."""
    out, at = {}, 0
    for k, v in like.items():
        out[k] = rows[:, at:at + v.numel()].reshape(len(rows), *v.shape)
        at += v.numel()
    return out


def _centralized(centrals: list[Central], args: argparse.Namespace) -> list[list[float]]:
    """One lane per (union, seed): rounds x local epochs epochs, one optimizer throughout;
    the curve is read every local_epochs epochs, as a round of the fleet."""
    _start_process()
    model = make_model(args.hidden)
    data = [(torch.cat(c.fleet.x), torch.cat(c.fleet.y)) for c in centrals]
    groups = [(torch.Generator().manual_seed(c.fleet.seed), 1) for c in centrals]
    lanes = Lanes(model, data, args.batch, Optim(args.lr, args.momentum, args.weight_decay),
                  groups)
    init = [init_params(args.hidden, c.fleet.seed) for c in centrals]
    like = init[0]
    rows = torch.stack([flat(p, 1)[0] for p in init])
    params = {k: v.clone() for k, v in unflat_lanes(rows, like).items()}
    buf = {k: torch.zeros_like(v) for k, v in params.items()}
    none = torch.zeros(len(centrals))
    curves: list[list[float]] = [[] for _ in centrals]

    def score() -> None:
        for curve, c, row in zip(curves, centrals, flat(params, len(centrals)), strict=True):
            curve.append(accuracy(model, unflat(row, like), c.fleet.test_x, c.fleet.test_y))

    score()
    for _ in range(args.rounds):
        for _ in range(args.local_epochs):
            lanes.epoch(params, buf, None, none)
        score()
    return curves


# --- personalization --------------------------------------------------------------------------

def personalize(runs: list[Run], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per personalization run (fedavg on devices holding part of their data out), each
    device's held-out data scored by (a) its local-only model: the same model trained on its
    own training part alone, from the run's initial weights, for rounds x local epochs epochs
    (the compute it spends in the federated run), the checkpoint of its ten with the best
    validation accuracy; (b) the global model; (c) the global model with its last layer
    fine-tuned on the device's training part for ``--head-epochs`` epochs (the body frozen,
    a fresh optimizer); (d) the global model fine-tuned whole for ``--ft-epochs`` epochs, the
    epoch (0: the global model as it came) with the best validation accuracy; and (e) what
    the device serves: of (a), (c) and (d), the one with the best validation accuracy, as a
    device's health check keeps the better of its active model and a candidate on its own
    held-out data. And the union of the held-out parts: the global model, each device's
    local-only model, and the served models (each device's part by its own)."""
    _start_process()
    n, model = args.devices, make_model(args.hidden)
    like = init_params(args.hidden, 0)
    head = list(like)[-2:]  # the last Linear's weight and bias
    data = [(x, y) for r in runs for x, y in zip(r.fleet.x, r.fleet.y, strict=True)]
    val = [(x, y) for r in runs for x, y in zip(r.fleet.val_x, r.fleet.val_y, strict=True)]
    optim = Optim(args.lr, args.momentum, args.weight_decay)
    none = torch.zeros(len(data))

    def scored(rows: torch.Tensor) -> list[float]:
        return [accuracy(model, unflat(rows[k], like), *val[k]) for k in range(len(val))]

    def train(rows: torch.Tensor, epochs: int, salt: int, frozen: Sequence[str],
              checks: int = 0) -> torch.Tensor:
        """``rows`` trained ``epochs`` epochs; with ``checks``, each lane's checkpoint (of
        ``checks`` evenly spaced, the start included) with the best validation accuracy."""
        lanes = Lanes(model, data, args.batch, optim,
                      [(torch.Generator().manual_seed(r.fleet.seed + salt), n) for r in runs],
                      frozen=frozen)
        params = {k: v.clone() for k, v in unflat_lanes(rows, like).items()}
        buf = {k: torch.zeros_like(v) for k, v in params.items()}
        best, best_acc = rows.clone(), scored(rows) if checks else []
        every = max(1, epochs // checks) if checks else 0
        for e in range(1, epochs + 1):
            lanes.epoch(params, buf, None, none)
            if checks and (e % every == 0 or e == epochs):
                now = flat(params, len(rows))
                for k, acc in enumerate(scored(now)):
                    if acc > best_acc[k]:  # ties keep the earlier: less fitted to its data
                        best[k], best_acc[k] = now[k], acc
        return best if checks else flat(params, len(rows))

    assert all(r.final is not None for r in runs)
    glob_rows = torch.stack([r.final for r in runs for _ in range(n)])  # type: ignore[misc]
    local = train(torch.stack([flat(init_params(args.hidden, r.fleet.seed), 1)[0]
                               for r in runs for _ in range(n)]),
                  args.rounds * args.local_epochs, 31, (), checks=10)
    personal = train(glob_rows, args.head_epochs, 47, [k for k in like if k not in head])
    tuned = train(glob_rows, args.ft_epochs, 53, (), checks=min(10, args.ft_epochs))
    val_acc = {"local": scored(local), "head": scored(personal), "ft": scored(tuned)}
    out = []
    for j, r in enumerate(runs):
        f, glob = r.fleet, unflat(r.final, like)  # type: ignore[arg-type]
        ux, uy = torch.cat(f.own_x), torch.cat(f.own_y)
        devices = []
        for i in range(n):
            k, mine = j * n + i, (f.own_x[i], f.own_y[i])
            acc = {"local": accuracy(model, unflat(local[k], like), *mine),
                   "head": accuracy(model, unflat(personal[k], like), *mine),
                   "ft": accuracy(model, unflat(tuned[k], like), *mine)}
            # The served model: the best on validation; a tie goes to the fleet's (ft, then
            # head) over the device's own.
            pick = max(("ft", "head", "local"), key=lambda m: val_acc[m][k])
            devices.append({"held_out": len(f.own_y[i]), "validation": len(f.val_y[i]),
                            "global": accuracy(model, glob, *mine), **acc,
                            "served": acc[pick], "served_by": pick,
                            "val": {"global": accuracy(model, glob, *val[k]),
                                    **{m: v[k] for m, v in val_acc.items()}}})
        served = sum(d["served"] * d["held_out"] for d in devices) / len(uy)
        out.append({"partition": f.spec, "seed": f.seed, "devices": devices, "union": {
            "held_out": len(uy), "global": accuracy(model, glob, ux, uy),
            "served": served,
            "local": [accuracy(model, unflat(local[j * n + i], like), ux, uy)
                      for i in range(n)]}})
    return out


def personal_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per partition: per device (mean over seeds) its accuracy on its held-out data by each
    model and the served one; the union; and the issue's two comparisons, per device and
    seed."""
    out: dict[str, Any] = {}
    keys = ("held_out", "local", "global", "head", "ft", "served")
    for spec in dict.fromkeys(r["partition"] for r in results):
        rs = [r for r in results if r["partition"] == spec]
        n = len(rs[0]["devices"])
        per_device = [{k: float(np.mean([r["devices"][i][k] for r in rs])) for k in keys}
                      for i in range(n)]
        gaps = [100 * (d["served"] - max(d["local"], d["global"]))
                for r in rs for d in r["devices"]]
        union_gaps = [100 * (r["union"]["global"] - max(r["union"]["local"])) for r in rs]
        picks = [d["served_by"] for r in rs for d in r["devices"]]
        out[spec] = {
            "seeds": len(rs), "devices": per_device,
            "served_by": {m: picks.count(m) for m in ("ft", "head", "local")},
            "union": {"held_out": rs[0]["union"]["held_out"],
                      "global": float(np.mean([r["union"]["global"] for r in rs])),
                      "served": float(np.mean([r["union"]["served"] for r in rs])),
                      "best_local": float(np.mean([max(r["union"]["local"]) for r in rs])),
                      "mean_local": float(np.mean([np.mean(r["union"]["local"]) for r in rs]))},
            "served_vs_better": {"met": sum(g >= 0 for g in gaps), "of": len(gaps),
                                 "worst_points": min(gaps), "mean_points": float(np.mean(gaps))},
            "global_vs_every_local_on_union": {"met": sum(g >= 0 for g in union_gaps),
                                               "of": len(union_gaps),
                                               "worst_points": min(union_gaps)}}
    return out


def print_personal(ps: dict[str, Any], args: argparse.Namespace) -> None:
    for spec, s in ps.items():
        print(f"\npersonalization on {spec} (fedavg; {100 * args.personal_holdout:g} % of each "
              f"device's data held out as its test set and as much as its validation set; "
              f"head fine-tune {args.head_epochs} epochs, whole fine-tune up to "
              f"{args.ft_epochs}; mean over {s['seeds']} seeds)")
        print(f"  {'device':>6} {'held out':>8} {'local only':>10} {'global':>7} "
              f"{'head':>7} {'whole':>7} {'served':>7}")
        for i, d in enumerate(s["devices"]):
            print(f"  {i:>6} {d['held_out']:>8.1f} {d['local']:>10.4f} {d['global']:>7.4f} "
                  f"{d['head']:>7.4f} {d['ft']:>7.4f} {d['served']:>7.4f}")
        u, by = s["union"], s["served_by"]
        print(f"  union ({u['held_out']} held out): global {u['global']:.4f}, served "
              f"{u['served']:.4f}, best local-only model {u['best_local']:.4f} "
              f"(mean {u['mean_local']:.4f}); served: whole fine-tune {by['ft']}, head "
              f"{by['head']}, local only {by['local']} device-seeds")


# --- report -----------------------------------------------------------------------------------


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def mean_curve(curves: list[list[float]]) -> list[float]:
    return np.mean(np.asarray(curves, dtype=np.float64), axis=0).tolist()


def first_round(curve: Sequence[float], level: float) -> int | None:
    return next((i for i, a in enumerate(curve) if a >= level), None)


def summarize(runs: list[Run], centrals: dict[str, list[Central]],
              args: argparse.Namespace) -> dict[str, Any]:
    """Per (partition, rule, attack): accuracy at the last round and at round 50 (mean, sd
    over seeds), the mean curve, the round it reaches 0.95 x centralized."""
    at = min(TARGET_BY_ROUND, args.rounds)
    out: dict[str, Any] = {"centralized": {}, "federated": {}}
    for spec, cs in centrals.items():
        final, sd = mean_sd([c.curve[-1] for c in cs])
        at50 = mean_sd([c.curve[at] for c in cs])[0]
        out["centralized"][spec] = {"final": final, "sd": sd, "at_target_round": at50,
                                    "curve": mean_curve([c.curve for c in cs])}
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for r in runs:
        if r.attack != "personal":  # scored per device by personal_summary
            groups.setdefault(r.key, []).append(r)
    for (spec, rule, att), rs in groups.items():
        bound = out["centralized"][spec]["final"]
        curve = mean_curve([r.curve for r in rs])
        final, sd = mean_sd([r.curve[-1] for r in rs])
        at_round, at_sd = mean_sd([r.curve[at] for r in rs])
        out["federated"][f"{spec} | {rule} | {att}"] = {
            "partition": spec, "rule": rule, "attack": att, "final": final, "sd": sd,
            "at_target_round": at_round, "at_target_round_sd": at_sd,
            "ratio_at_target_round": at_round / out["centralized"][spec]["at_target_round"],
            "round_to_95": first_round(curve, TARGET_RATIO * bound), "curve": curve,
            "seeds": [r.curve[-1] for r in rs], "notes": sorted({r.note for r in rs} - {""}),
        }
    return out


def row(s: dict[str, Any], clean: float | None = None) -> str:
    r95 = "-" if s["round_to_95"] is None else str(s["round_to_95"])
    extra = "" if clean is None else f" {100 * (s['final'] - clean):+7.1f}"
    return (f"  {s['rule']:<13} {s['final']:.4f} +- {s['sd']:.4f} {s['ratio_at_target_round']:7.3f}"
            f" {r95:>6}{extra}{'  ' + '; '.join(s['notes']) if s['notes'] else ''}")


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> None:
    at = min(TARGET_BY_ROUND, args.rounds)
    fed = summary["federated"]
    for spec, c in summary["centralized"].items():
        print(f"\n{spec}: centralized {c['final']:.4f} +- {c['sd']:.4f} (round {at}: "
              f"{c['at_target_round']:.4f})")
        print(f"  {'rule':<13} {'acc (mean +- sd)':<17} {'/cent@' + str(at):>7} {'r->95%':>6}")
        for s in fed.values():
            if s["partition"] == spec and s["attack"] == "none":
                print(row(s))
    attacked = [s for s in fed.values() if s["attack"] in ATTACKS]
    if attacked:
        spec = attacked[0]["partition"]
        clean = fed.get(f"{spec} | fedavg | none")
        base = clean["final"] if clean else None
        print(f"\nunder attack on {spec}, {args.attackers} of {args.devices} devices "
              f"(alie z = {alie_z(args.devices, args.attackers):.3f}); last column: points vs "
              "clean fedavg")
        for att in ATTACKS:
            rows = [s for s in attacked if s["attack"] == att]
            if rows:
                print(f" {att}")
                for s in rows:
                    print(row(s, base))


def stragglers_summary(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy by round of every device on time (= waiting for everyone), and of rounds
    closed at the on-time quorum, late updates discounted or dropped; then by simulated time:
    a round that waits for everyone lasts ``slowdown`` units, a quorum round one."""
    fed = summary["federated"]
    spec = args.straggler_partition
    clean = fed.get(f"{spec} | fedavg | none")
    cases = {k: fed[f"{spec} | fedavg | {k}"] for k in LATE if f"{spec} | fedavg | {k}" in fed}
    if clean is None or not cases:
        return {}
    slow = Fraction(args.straggler_slowdown)
    marks = sorted({m for m in (10, 25, TARGET_BY_ROUND, args.rounds) if m <= args.rounds})
    by_round = {"on time": {m: clean["curve"][m] for m in marks}}
    by_round.update({k: {m: c["curve"][m] for m in marks} for k, c in cases.items()})
    by_time = {m: {"wait for everyone": clean["curve"][math.floor(m / slow)],
                   "rounds waiting": math.floor(m / slow),
                   **{k: c["curve"][m] for k, c in cases.items()}} for m in marks}
    jobs = straggler_jobs(args.rounds, slow)
    return {"partition": spec, "stragglers": args.stragglers, "devices": args.devices,
            "slowdown": float(slow), "max_staleness": args.max_staleness,
            "discount": {str(st): staleness_scale(st) for st in sorted({c - b for b, c in jobs})},
            "straggler_updates_per_device": len(jobs), "by_round": by_round, "by_time": by_time,
            "curves": {"on time": clean["curve"], **{k: c["curve"] for k, c in cases.items()}}}


def print_stragglers(st: dict[str, Any]) -> None:
    if not st:
        return
    disc = ", ".join(f"staleness {k}: x {v:.3f}" for k, v in st["discount"].items())
    print(f"\nstragglers on {st['partition']}, fedavg: the last {st['stragglers']} of "
          f"{st['devices']} devices take {st['slowdown']:g} round durations a fine-tune; a round "
          f"closes at its quorum of {st['devices'] - st['stragglers']} on-time devices (1 unit); "
          f"each straggler lands {st['straggler_updates_per_device']} updates, late "
          f"({disc}; --max-staleness {st['max_staleness']})")
    cases = list(st["by_round"])
    print(f"  {'round':>6} " + " ".join(f"{c:>26}" for c in cases))
    for m in next(iter(st["by_round"].values())):
        print(f"  {m:>6} " + " ".join(f"{st['by_round'][c][m]:>26.4f}" for c in cases))
    print(f"  simulated time (units): wait for everyone ({st['slowdown']:g} units a round) "
          "vs quorum rounds")
    for m, row_ in st["by_time"].items():
        rest = "  ".join(f"{k} {v:.4f}" for k, v in row_.items()
                         if k not in ("wait for everyone", "rounds waiting"))
        print(f"  {m:>6}  wait for everyone {row_['wait for everyone']:.4f} "
              f"({row_['rounds waiting']} rounds)  {rest}")


def targets(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    fed = summary["federated"]
    out: dict[str, Any] = {"ratio": {}}
    for spec in (HEADLINE, *BESIDE):
        s = fed.get(f"{spec} | fedavg | none")
        if s is not None:
            out["ratio"][spec] = {"value": s["ratio_at_target_round"],
                                  "met": s["ratio_at_target_round"] >= TARGET_RATIO}
    clean = fed.get(f"{args.attack_partition} | fedavg | none")
    alie = {s["rule"]: s["final"] for s in fed.values() if s["attack"] == "alie"}
    if clean is not None and alie:
        best = max(alie, key=lambda k: alie[k])
        points = 100 * (alie[best] - clean["final"])
        out["alie"] = {"best_rule": best, "points_vs_clean_fedavg": points,
                       "met": points >= -ALIE_POINTS,
                       "by_rule": {k: 100 * (v - clean["final"]) for k, v in alie.items()}}
    for spec, p in (summary.get("personal") or {}).items():
        pv, gu = p["served_vs_better"], p["global_vs_every_local_on_union"]
        out.setdefault("personal", {})[spec] = {
            "served_vs_better": pv, "global_vs_every_local_on_union": gu,
            "met": pv["met"] == pv["of"] and gu["met"] == gu["of"]}
    st = stragglers_summary(summary, args)
    if st and "stragglers" in st["by_round"]:
        at_time = st["by_time"][max(st["by_time"])]
        out["stragglers"] = {
            "time_units": max(st["by_time"]), "quorum": at_time["stragglers"],
            "wait_for_everyone": at_time["wait for everyone"],
            "met": at_time["stragglers"] >= at_time["wait for everyone"]}
    return out


def print_targets(t: dict[str, Any], args: argparse.Namespace) -> None:
    at = min(TARGET_BY_ROUND, args.rounds)
    print("\ntargets")
    for spec, v in t["ratio"].items():
        print(f"  fedavg on {spec:<14} federated / centralized at round {at}: "
              f"{v['value']:.3f} (>= {TARGET_RATIO}: {'met' if v['met'] else 'NOT met'})")
    if "alie" in t:
        a = t["alie"]
        print(f"  under ALIE the best rule, {a['best_rule']}, is "
              f"{a['points_vs_clean_fedavg']:+.1f} points vs clean fedavg (>= -{ALIE_POINTS:g}:"
              f" {'met' if a['met'] else 'NOT met'})")
    for spec, p in t.get("personal", {}).items():
        pv, gu = p["served_vs_better"], p["global_vs_every_local_on_union"]
        print(f"  {spec}: personalized serving >= the better of (local only, global) on "
              f"{pv['met']}/{pv['of']} device-seeds (worst {pv['worst_points']:+.1f} points, "
              f"mean {pv['mean_points']:+.1f}); global >= every local-only model on the union "
              f"in {gu['met']}/{gu['of']} seeds (worst {gu['worst_points']:+.1f} points): "
              f"{'met' if p['met'] else 'NOT met'}")
    if "stragglers" in t:
        g = t["stragglers"]
        print(f"  stragglers: at {g['time_units']} units of simulated time, quorum rounds with "
              f"late updates discounted {g['quorum']:.4f} >= waiting for everyone "
              f"{g['wait_for_everyone']:.4f}: {'met' if g['met'] else 'NOT met'}")


def print_verdict(t: dict[str, Any], args: argparse.Namespace) -> None:
    at = min(TARGET_BY_ROUND, args.rounds)
    head = HEADLINE if HEADLINE in t["ratio"] else next(iter(t["ratio"]), None)
    also = [(f"{spec} ratio", v["met"]) for spec, v in t["ratio"].items() if spec != head]
    if "alie" in t:
        also.append(("ALIE within 2 points", t["alie"]["met"]))
    also += [(f"personalization on {spec}", p["met"])
             for spec, p in t.get("personal", {}).items()]
    if "stragglers" in t:
        also.append(("quorum rounds >= waiting for everyone", t["stragglers"]["met"]))
    value = t["ratio"][head]["value"] if head else float("nan")
    verdict(f"fedavg on {head} federated / centralized accuracy at round {at}", value, ">=",
            TARGET_RATIO, also=also)


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Accuracy against round (mean over seeds): per partition each rule beside the
    centralized bound, then per attack each rule beside clean fedavg."""
    from hpc_core.plots import figure, write_png

    fed = list(summary["federated"].values())
    panels: list[tuple[str, list[dict[str, Any]], list[float], str]] = []
    for spec, c in summary["centralized"].items():
        panels.append((spec, [s for s in fed if s["partition"] == spec and s["attack"] == "none"],
                       c["curve"], "centralized"))
    for att in ATTACKS:
        hit = [s for s in fed if s["attack"] == att]
        if hit:
            clean = summary["federated"].get(f"{hit[0]['partition']} | fedavg | none")
            panels.append((f"{hit[0]['partition']} under {att}", hit,
                           clean["curve"] if clean else [], "clean fedavg"))
    st = summary.get("stragglers") or {}
    if st:
        series = [{"rule": k, "curve": v} for k, v in st["curves"].items() if k != "on time"]
        panels.append((f"{st['partition']}, {st['stragglers']} stragglers (x{st['slowdown']:g})"
                       " by round", series, st["curves"]["on time"], "all on time"))
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig = figure(figsize=(5.0 * cols, 3.6 * rows_n), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows_n, cols)).ravel()
    for ax, (title, series, ref, ref_label) in zip(axes, panels, strict=False):
        if ref:
            ax.plot(ref, color="black", linestyle="--", label=ref_label)
        for s in series:  # one colour per rule in every panel
            colour = (f"C{ALL_RULES.index(s['rule'])}" if s["rule"] in ALL_RULES
                      else f"C{len(ALL_RULES) + list(LATE).index(s['rule'])}")
            ax.plot(s["curve"], label=LATE.get(s["rule"], s["rule"]), linewidth=1.0,
                    color=colour)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return write_png(fig, path)


# --- main -------------------------------------------------------------------------------------

class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _names(text: str, allowed: Sequence[str], flag: str,
           ap: argparse.ArgumentParser) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in allowed]
    if bad or not names:
        ap.error(f"{flag} {text!r}: a comma list of {', '.join(allowed)}")
    return names


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--devices", type=int, default=10, help="devices in the fleet")
    ap.add_argument("--rounds", type=int, default=50, help="federated rounds")
    ap.add_argument("--local-epochs", type=int, default=10, help="device epochs per round")
    ap.add_argument("--batch", type=int, default=64, help="batch size (devices and central)")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--weight-decay", type=float, default=1e-5, help="SGD weight decay")
    ap.add_argument("--hidden", default="128,64", help="the mlp's hidden widths")
    ap.add_argument("--partitions", default=";".join(DEFAULT_PARTITIONS),
                    help="';' between partition specs (hpc_core.partitions)")
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES),
                    help=f"comma list of {', '.join(ALL_RULES)}")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--test-fraction", type=float, default=0.2, help="held-out test share")
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma list of {', '.join(ATTACKS)}, or 'none'")
    ap.add_argument("--attack-rules", default=None,
                    help="rules run under attack (default: --rules but fedprox and dp-fedavg)")
    ap.add_argument("--attack-partition", default=HEADLINE, help="the partition attacked")
    ap.add_argument("--attackers", type=int, default=2, help="poisoned devices (the last ones)")
    ap.add_argument("--attack-scale", type=float, default=50.0,
                    help="scale: delta x k; flip: delta x -k")
    ap.add_argument("--stragglers", type=int, default=2,
                    help="straggling devices (the last ones), fedavg; 0: no straggler runs")
    ap.add_argument("--straggler-slowdown", default="2",
                    help="a straggler's fine-tune in round durations (a fraction, >= 1)")
    ap.add_argument("--max-staleness", type=int, default=2,
                    help="late updates combined up to this many releases behind the base")
    ap.add_argument("--straggler-partition", default=HEADLINE,
                    help="the partition the straggler runs use")
    ap.add_argument("--personal", default=";".join(PERSONAL),
                    help="';' between partitions scored per device for personalization, or "
                         "'none'")
    ap.add_argument("--personal-holdout", type=float, default=0.2,
                    help="personalization: share of each device's data held out as its test")
    ap.add_argument("--head-epochs", type=int, default=5,
                    help="personalization: epochs of the last layer's local fine-tune")
    ap.add_argument("--ft-epochs", type=int, default=250,
                    help="personalization: most epochs of the whole model's local fine-tune "
                         "(the best epoch on the device's validation data kept)")
    ap.add_argument("--trim", type=float, default=0.2, help="trimmed-mean: dropped a side")
    ap.add_argument("--prox-mu", type=float, default=0.01, help="fedprox: proximal mu")
    ap.add_argument("--dp-epsilon", type=float, default=8.0, help="dp-fedavg: epsilon budget")
    ap.add_argument("--dp-delta", type=float, default=1e-5, help="dp-fedavg: delta")
    ap.add_argument("--dp-clip", type=float, default=1.0, help="dp-fedavg: L2 clip per update")
    ap.add_argument("--lanes", type=int, default=200,
                    help="devices a process trains at a time (a chunk of runs)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes, one torch thread each")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--plot", type=Path, default=None, help="write the curves here (PNG)")
    args = parse_args(ap, {"devices": 3, "rounds": 2, "local_epochs": 1, "seeds": 1,
                           "hidden": "16", "attackers": 1, "test_fraction": 0.1,
                           "stragglers": 1, "personal": "cameras:plain,invert",
                           "workers": 1,
                           "partitions": "iid;dirichlet:0.5;labels:2+cameras:plain,invert",
                           "rules": "fedavg,fedprox,trimmed-mean,median"}, argv)
    try:
        args.hidden = [int(h) for h in args.hidden.split(",")]
    except ValueError:
        ap.error(f"--hidden {args.hidden!r}: comma list of widths, e.g. 200,200")
    args.partition_list = [p.strip() for p in args.partitions.split(";") if p.strip()]
    args.personal_list = ([] if args.personal == "none" else
                          [p.strip() for p in args.personal.split(";") if p.strip()])
    for spec in [*args.partition_list, args.attack_partition, args.straggler_partition,
                 *args.personal_list]:
        try:
            parse_spec(spec)
        except PartitionError as e:
            ap.error(f"--partitions: {e}")
    args.rule_list = _names(args.rules, ALL_RULES, "--rules", ap)
    args.attack_list = ([] if args.attacks == "none"
                        else _names(args.attacks, ATTACKS, "--attacks", ap))
    args.attack_rule_list = (_names(args.attack_rules, ALL_RULES, "--attack-rules", ap)
                             if args.attack_rules else
                             [r for r in args.rule_list if r not in ("fedprox", "dp-fedavg")])
    if args.devices < 1 or args.rounds < 1 or args.local_epochs < 1 or args.seeds < 1:
        ap.error("--devices, --rounds, --local-epochs and --seeds: at least 1")
    try:
        if Fraction(args.straggler_slowdown) < 1:
            raise ValueError
    except (ValueError, ZeroDivisionError):
        ap.error(f"--straggler-slowdown {args.straggler_slowdown!r}: a number >= 1 (round "
                 "durations a straggler's fine-tune takes), e.g. 2 or 3/2")
    if not 0 <= args.stragglers < args.devices or args.max_staleness < 0:
        ap.error(f"--stragglers {args.stragglers}: fewer than --devices {args.devices}; "
                 f"--max-staleness {args.max_staleness}: 0 or more")
    if not 0 < args.personal_holdout < 0.5 or args.head_epochs < 1 or args.ft_epochs < 1:
        ap.error(f"--personal-holdout {args.personal_holdout}: a fraction in (0, 0.5) (held "
                 f"out twice: test and validation); --head-epochs {args.head_epochs} and "
                 f"--ft-epochs {args.ft_epochs}: at least 1")
    if not 0 <= args.attackers < args.devices:
        ap.error(f"--attackers {args.attackers}: fewer than --devices {args.devices}")
    return args


def plan(args: argparse.Namespace, fleets: dict[tuple[str, int], Fleet],
         progress: Callable[[str], None]) -> list[Run]:
    """Every rule on every partition, clean; the attack rules under each attack on the
    attacked partition (with clean fedavg there, the reference)."""
    skipped = sorted({r for r in (*args.rule_list, *args.attack_rule_list)
                      if not runnable(r, args)})
    if skipped:
        progress(f"skipped {', '.join(skipped)}: Krum needs N >= 2f + 3 devices, "
                 f"{args.devices} here")
    runs: list[Run] = []
    for (spec, _seed), fleet in fleets.items():
        clean = list(args.rule_list) if spec in args.partition_list else []
        if ((spec == args.attack_partition and args.attack_list)
                or (spec == args.straggler_partition and args.stragglers)) \
                and "fedavg" not in clean:
            clean.append("fedavg")
        runs += [Run(fleet, name, *rule_for(name, args)) for name in clean
                 if runnable(name, args)]
        if spec == args.attack_partition:
            runs += [Run(fleet, name, *rule_for(name, args), attack=att)
                     for att in args.attack_list for name in args.attack_rule_list
                     if runnable(name, args)]
        if spec == args.straggler_partition and args.stragglers:
            runs += [Run(fleet, "fedavg", Rule(), 0.0, attack=case, stragglers=args.stragglers,
                         slowdown=Fraction(args.straggler_slowdown),
                         max_staleness=args.max_staleness if case == "stragglers" else 0)
                     for case in LATE]
    return runs


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    print(cpu_line(), flush=True)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    specs = list(dict.fromkeys([*args.partition_list,
                                *([args.attack_partition] if args.attack_list else []),
                                *([args.straggler_partition] if args.stragglers else [])]))
    fleets = {(spec, seed): make_fleet(spec, seed, args.devices, args.test_fraction)
              for spec in specs for seed in range(args.seeds)}
    for (spec, seed), f in fleets.items():
        if seed == 0:
            progress(f"{spec}: device sizes {f.samples}")
    centrals = {spec: [Central(fleets[(spec, s)]) for s in range(args.seeds)] for spec in specs}
    runs = plan(args, fleets, progress)
    personal_runs = [Run(hold_out(make_fleet(spec, seed, args.devices, args.test_fraction),
                                  args.personal_holdout), "fedavg", Rule(), 0.0,
                         attack="personal")
                     for spec in args.personal_list for seed in range(args.seeds)]
    runs += personal_runs
    progress(f"{len(runs)} federated runs of {args.rounds} rounds x {args.local_epochs} epochs "
             f"x {args.devices} devices, {len(specs) * args.seeds} centralized runs of "
             f"{args.rounds * args.local_epochs} epochs, {args.workers} worker processes")
    run_all(runs, [c for cs in centrals.values() for c in cs], args, progress)
    wall = time.perf_counter() - t0
    summary = summarize(runs, centrals, args)
    summary["stragglers"] = stragglers_summary(summary, args)
    if personal_runs:
        summary["personal"] = personal_summary(personalize(personal_runs, args))
        progress("personalization done")
    wall = time.perf_counter() - t0
    print(f"\nwall time {wall:.0f} s")
    print_tables(summary, args)
    print_stragglers(summary["stragglers"])
    print_personal(summary.get("personal") or {}, args)
    t = targets(summary, args)
    print_targets(t, args)
    if args.plot:
        print(f"curves: {plot(summary, args.plot)}")
    if args.json:
        figures = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "cpu": cpu_line(), "wall_s": wall, "summary": summary, "targets": t}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    print_verdict(t, args)


if __name__ == "__main__":
    main()
