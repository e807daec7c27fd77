"""When fleet learning pays a device: each device alone, beside the fleet's release and the
release fine-tuned on the device, by how many labelled samples a device holds and how many
devices the fleet has.

The question ``make demo``'s fleet-learning table should answer with figures: a device that
trains alone on its few labelled images, against what it gets from the fleet. The devices'
model and data are the demo's: ``small_cnn`` (width 16, BatchNorm, configs/digits.yaml) at
16 x 16 px, sklearn's digits (nothing downloaded).

* **Upstream.** The base is trained on a seeded ``--upstream-share`` (30 %) of the digits,
  clean: AdamW, lr 0.003, weight decay 0.01, batch 64, 12 epochs (the config's recipe, without
  its warm-up and cosine decay). The devices deal out the rest; nobody else sees it.
* **Devices.** ``--devices`` fleet sizes (3, the demo's, and 10); each fleet has one more
  device outside it, the *new device*. Their data: :mod:`hpc_core.partitions`' spec
  ``--labels`` (``dirichlet:2``: mild label skew) ``+cameras:--cameras`` (every site an IR
  camera upstream never saw, half of them with a soft lens: ``invert,invert/blur``). A device
  holds ``--samples`` labelled samples for training (10 to 80), half as many again as its
  validation set, and up to ``--test`` more as its test set (scored only here).
* **A device's training** (alone, a fleet round and the fine-tune of a release alike):
  AdamW, ``--lr`` 0.005, weight decay 0.01, batch 16, every layer trained. *Alone*: from the
  base for ``--epochs`` (40) epochs, its best epoch on its validation set kept (epoch 0: the
  base), as the device's health check keeps the better model: trained to convergence, not
  stopped early in its favour or against it.
* **The fleet.** ``--rounds`` (10) rounds; in each, every fleet device trains
  ``--local-epochs`` (5) epochs from the release and uploads the difference; the round's
  release is ``hpc_core.aggregation.in_memory.combine_updates`` of the weights' deltas
  (``hpc-train aggregate``'s fedavg, weighted by samples) and the sample-weighted mean of
  BatchNorm's running statistics (as ``hpc-train aggregate`` combines buffers). *Release*:
  the last round's model as it is. *Release + own fine-tune*: that model trained on the
  device's data as *alone* is from the base (same epochs, best epoch on validation).
* **What a device serves** from the fleet: the better on its validation set of the release
  and the release + own fine-tune. "Fleet beats alone" counts the devices where that model's
  test accuracy is above the device's alone; for the new device too (it never took part).

What is simulated: everything runs in this one process, one device after another; on a fleet
each training is a device's ``finetune`` job, each round ``fleetctl learn``'s (aggregate,
evaluate, publish). What is not: the model, the data, the cameras, the label skew and the
rule that combines the updates.

    python benchmarks/fleet_pays.py                  # 3 seeds, 3 and 10 devices, ~5 min
    python benchmarks/fleet_pays.py --quick          # seconds: the same path, tiny
    python benchmarks/fleet_pays.py --json fp.json --plot fp.png
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import cpu_line, parse_args, verdict  # noqa: E402
from hpc_core.aggregation.in_memory import Rule, combine_updates  # noqa: E402
from hpc_core.data import load_digits_tensors  # noqa: E402
from hpc_core.models import build_model  # noqa: E402
from hpc_core.partitions import PartitionError, device_data, parse_spec, split  # noqa: E402

IMAGE_SIZE = 16  # the demo's (configs/digits.yaml)
BATCH = 16
DEMO_DEVICES = 3
"""The demo's fleet: the verdict's regime is this many devices at the fewest samples."""
Model = torch.nn.Module


class TooFew(ValueError):
    """The digits cannot give every device of this fleet its samples."""


@dataclass
class Device:
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]


def make_model() -> Model:
    return build_model("small_cnn", num_classes=10, in_channels=1, image_size=IMAGE_SIZE,
                       width=16, norm="batch")


def epochs(model: Model, data: tuple[torch.Tensor, torch.Tensor], lr: float, batch: int,
           seed: int) -> Iterator[int]:
    """Train ``model`` in place with one AdamW, an epoch at a time; yields the epochs done.
    ``seed`` orders the batches and seeds the global generator (small_cnn's dropout), so a
    device's training does not depend on what ran before it."""
    x, y = data
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for done in itertools.count(1):
        model.train()
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            b = order[i:i + batch]
            if len(b) < 2:  # BatchNorm needs two samples
                continue
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        yield done


def train(model: Model, data: tuple[torch.Tensor, torch.Tensor], epochs_n: int, lr: float,
          batch: int, seed: int) -> Model:
    """``epochs_n`` epochs of AdamW on ``data`` (in place); returns ``model``."""
    if epochs_n > 0:
        for done in epochs(model, data, lr, batch, seed):
            if done == epochs_n:
                break
    return model


@torch.no_grad()
def accuracy(model: Model, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    x, y = data
    return float((model(x).argmax(1) == y).float().mean())


def fit(start: Model, dev: Device, n_epochs: int, lr: float, seed: int) -> Model:
    """``start`` trained on the device's data for ``n_epochs`` epochs, its best epoch on the
    device's validation set kept (epoch 0: ``start`` itself)."""
    model = copy.deepcopy(start)
    best, best_state = accuracy(model, dev.val), copy.deepcopy(model.state_dict())
    if n_epochs > 0:
        for done in epochs(model, dev.train, lr, BATCH, seed):
            acc = accuracy(model, dev.val)
            if acc > best:
                best, best_state = acc, copy.deepcopy(model.state_dict())
            if done == n_epochs:
                break
    model.load_state_dict(best_state)
    return model


def fedavg(release: Model, updates: list[Model], samples: list[int]) -> Model:
    """The next release: the weights' deltas combined by the product's fedavg rule, the
    BatchNorm statistics by their sample-weighted mean."""
    names = [n for n, _ in release.named_parameters()]
    base = release.state_dict()
    states = [m.state_dict() for m in updates]
    deltas = np.stack([torch.cat([(st[n] - base[n]).reshape(-1) for n in names]).numpy()
                       for st in states])
    step = torch.from_numpy(combine_updates(deltas, samples, Rule("fedavg"))).float()
    state, at = {}, 0
    for n in names:
        k = base[n].numel()
        state[n] = base[n] + step[at:at + k].reshape(base[n].shape)
        at += k
    w = torch.tensor(samples, dtype=torch.float64) / sum(samples)
    for n, v in base.items():
        if n in state:
            continue
        if v.dtype.is_floating_point:  # running mean and variance
            mean = sum(wi * st[n].double() for wi, st in zip(w, states, strict=True))
            state[n] = torch.as_tensor(mean).to(v.dtype)
        else:  # num_batches_tracked
            state[n] = v
    out = copy.deepcopy(release)
    out.load_state_dict(state)
    return out


def upstream(x: torch.Tensor, y: torch.Tensor, seed: int) -> Model:
    torch.manual_seed(seed)
    return train(make_model(), (x, y), 12, lr=0.003, batch=64, seed=seed)


def devices(x: torch.Tensor, y: torch.Tensor, spec: str, count: int, samples: int,
            test: int, seed: int) -> list[Device]:
    """``count`` devices dealt from (x, y) by ``spec``; each one's first ``samples`` for
    training, half as many for validation, up to ``test`` for its test set."""
    val = max(samples // 2, 5)
    out = []
    for i, shard in enumerate(split(spec, y.numpy(), count, seed=seed)):
        dx, dy = device_data(x, y, shard, seed=seed * 100 + i)
        left = len(dy) - samples - val
        if left < 10:
            raise TooFew(f"{spec} over {count} devices gives device {i} {len(dy)} samples: "
                         f"not enough for {samples} + {val} + a test set of 10")
        parts = np.cumsum([samples, val, min(test, left)])
        out.append(Device((dx[:parts[0]], dy[:parts[0]]), (dx[parts[0]:parts[1]],
                          dy[parts[0]:parts[1]]), (dx[parts[1]:parts[2]], dy[parts[1]:parts[2]])))
    return out


def one_run(base: Model, pool: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace,
            fleet_size: int, samples: int, seed: int) -> list[dict[str, Any]]:
    """Every device of one fleet (and its new device): its figures on its test set."""
    spec = f"{args.labels}+cameras:{args.cameras}"
    devs = devices(*pool, spec, fleet_size + 1, samples, args.test, seed)
    fleet = devs[:fleet_size]
    release = base
    for r in range(args.rounds):
        updates = [train(copy.deepcopy(release), d.train, args.local_epochs, args.lr, BATCH,
                         seed * 7919 + r * 101 + i) for i, d in enumerate(fleet)]
        release = fedavg(release, updates, [len(d.train[1]) for d in fleet])
    rows = []
    for i, d in enumerate(devs):
        alone = fit(base, d, args.epochs, args.lr, seed + i)
        own = fit(release, d, args.epochs, args.lr, seed + i)
        served = own if accuracy(own, d.val) > accuracy(release, d.val) else release
        rows.append({"device": i, "new": i == fleet_size, "alone": accuracy(alone, d.test),
                     "release": accuracy(release, d.test), "release_ft": accuracy(own, d.test),
                     "fleet": accuracy(served, d.test), "test_samples": len(d.test[1])})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def part(sel: list[dict[str, Any]]) -> dict[str, Any]:
        means = {k: float(np.mean([r[k] for r in sel]))
                 for k in ("alone", "release", "release_ft", "fleet")}
        return means | {
            "devices": len(sel),
            "release_beats": sum(r["release"] > r["alone"] for r in sel),
            "fleet_beats": sum(r["fleet"] > r["alone"] for r in sel),
            "release_worst_pts": 100 * min(r["release"] - r["alone"] for r in sel),
            "fleet_worst_pts": 100 * min(r["fleet"] - r["alone"] for r in sel)}
    return {"fleet": part([r for r in rows if not r["new"]]),
            "new": part([r for r in rows if r["new"]])}


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print("\nmean test accuracy on each device's own data; 'beats': devices (x seeds) where the "
          "model is above the device alone, and the worst difference")
    head = ("devices", "samples", "who", "alone", "release", "release+own ft", "served",
            "release beats", "worst", "served beats", "worst")
    rows = [head]
    for key, s in results.items():
        size, samples = key.split("x")
        for who in ("fleet", "new"):
            p = s[who]
            rows.append((size, samples, "in the fleet" if who == "fleet" else "new device",
                         f"{p['alone']:.1%}", f"{p['release']:.1%}", f"{p['release_ft']:.1%}",
                         f"{p['fleet']:.1%}", f"{p['release_beats']}/{p['devices']}",
                         f"{p['release_worst_pts']:+.1f} pts",
                         f"{p['fleet_beats']}/{p['devices']}",
                         f"{p['fleet_worst_pts']:+.1f} pts"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print("served: the better on the device's validation set of the release and the release "
          "+ own fine-tune")


def every(s: dict[str, Any]) -> bool:
    """The release beats the device alone on every device, the new ones included."""
    return all(s[w]["release_beats"] == s[w]["devices"] for w in ("fleet", "new"))


def plot(results: dict[str, dict[str, Any]], sizes: list[int], samples: list[int],
         path: Path) -> Path:
    """Accuracy against samples a device holds, one panel per fleet size: the device alone,
    the release, the release + own fine-tune (fleet devices solid, the new device dashed)."""
    from hpc_core.plots import figure, write_png

    fig = figure(figsize=(5.0 * len(sizes), 3.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(sizes)))
    for ax, size in zip(axes, sizes, strict=True):
        have = [n for n in samples if f"{size}x{n}" in results]
        for colour, (key, label) in enumerate((("alone", "alone"), ("release", "release"),
                                               ("release_ft", "release + own fine-tune"))):
            for who, style in (("fleet", "-"), ("new", "--")):
                ys = [results[f"{size}x{n}"][who][key] for n in have]
                ax.plot(have, ys, style, marker="o", color=f"C{colour}",
                        label=f"{label}{' (new device)' if who == 'new' else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(have, [str(n) for n in have])
        ax.set_title(f"{size} devices in the fleet", fontsize=9)
        ax.set_xlabel("labelled samples a device trains on")
        ax.set_ylabel("test accuracy on the device's data")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    return write_png(fig, path)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1")
    return values


def _at_least(low: int) -> Callable[[str], int]:
    def value(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n}: at least {low}")
        return n
    return value


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"{v}: a share between 0 and 1")
    return v


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=type(
            "Help", (argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter), {}))
    ap.add_argument("--devices", type=_ints, default=[3, 10], help="fleet sizes")
    ap.add_argument("--samples", type=_ints, default=[10, 20, 40, 80],
                    help="labelled training samples a device holds")
    ap.add_argument("--labels", default="dirichlet:2", help="label partition")
    ap.add_argument("--cameras", default="invert,invert/blur", help="the devices' cameras")
    ap.add_argument("--rounds", type=_at_least(1), default=10, help="fleet rounds")
    ap.add_argument("--local-epochs", type=_at_least(1), default=5,
                    help="device epochs a round")
    ap.add_argument("--epochs", type=_at_least(1), default=40,
                    help="epochs of a device alone and of the release's own fine-tune")
    ap.add_argument("--lr", type=float, default=0.005, help="the devices' AdamW learning rate")
    ap.add_argument("--test", type=_at_least(10), default=100,
                    help="test samples a device at most")
    ap.add_argument("--upstream-share", type=_share, default=0.3,
                    help="share of the digits upstream trains the base on")
    ap.add_argument("--seeds", type=_at_least(1), default=3, help="seeds 0..N-1")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--plot", type=Path, help="write the curves here (PNG)")
    args = parse_args(ap, {"devices": [2], "samples": [10], "rounds": 2, "local_epochs": 1,
                           "epochs": 2, "test": 20, "seeds": 1}, argv)
    if not args.lr > 0:
        ap.error(f"--lr {args.lr}: above 0")
    try:
        parse_spec(f"{args.labels}+cameras:{args.cameras}")
    except PartitionError as e:
        ap.error(f"--labels {args.labels!r} --cameras {args.cameras!r}: {e}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    print(cpu_line(), flush=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    t0 = time.perf_counter()
    x, y = load_digits_tensors(IMAGE_SIZE)
    rows: dict[str, list[dict[str, Any]]] = {f"{d}x{n}": [] for d in args.devices
                                             for n in args.samples}
    for seed in range(args.seeds):
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
        cut = int(args.upstream_share * len(y))
        base = upstream(x[order[:cut]], y[order[:cut]], seed)
        pool = (x[order[cut:]], y[order[cut:]])
        for key in rows:
            size, samples = (int(v) for v in key.split("x"))
            try:
                rows[key] += one_run(base, pool, args, size, samples, seed)
            except TooFew as e:
                print(f"seed {seed}: {size} devices x {samples} samples left out: {e}")
                continue
            print(f"[{time.perf_counter() - t0:6.1f} s] seed {seed}: {size} devices x "
                  f"{samples} samples", flush=True)
    results = {k: summarize(v) for k, v in rows.items() if v}
    if not results:
        raise SystemExit("no fleet size and sample count fits the digits: fewer --samples "
                         "or --devices")
    wall = time.perf_counter() - t0
    print(f"\nwall time {wall:.0f} s; {args.seeds} seeds, {args.rounds} rounds x "
          f"{args.local_epochs} local epochs, alone and own fine-tune {args.epochs} epochs; "
          f"data {args.labels}+cameras:{args.cameras}")
    print_table(results)
    if args.plot:
        print(f"curves: {plot(results, args.devices, args.samples, args.plot)}")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cpu": cpu_line(), "wall_s": wall, "results": results, "devices": rows},
            indent=1) + "\n")
    # The demo's regime: its fleet size (or the smallest asked) at the fewest samples.
    size = DEMO_DEVICES if DEMO_DEVICES in args.devices else min(args.devices)
    key = min((k for k in results if k.startswith(f"{size}x")), default=next(iter(results)),
              key=lambda k: int(k.split("x")[1]))
    s = results[key]
    beats = s["fleet"]["release_beats"] + s["new"]["release_beats"]
    total = s["fleet"]["devices"] + s["new"]["devices"]
    regime = key.replace("x", " devices x ") + " samples"
    verdict(f"devices where the fleet's release beats the device alone at {regime}",
            beats / total, ">=", 1.0,
            also=[(f"{k.replace('x', ' devices x ')} samples: every device", every(v))
                  for k, v in results.items() if k != key],
            note=f"{beats}/{total}; mean release {s['fleet']['release']:.1%} vs alone "
                 f"{s['fleet']['alone']:.1%}, new device {s['new']['release']:.1%} vs "
                 f"{s['new']['alone']:.1%}")

if __name__ == "__main__":
    main()
