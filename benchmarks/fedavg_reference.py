"""Plain FedAvg in a few lines of PyTorch, outside edgetrain's pipeline, on the same data.

``benchmarks/federated.py`` finds federated averaging far below the centralized bound on the
eight cameras. This asks whether that is the pipeline's doing (fine-tune recipe, uploads,
aggregation) or the model's: the same digits split, the same eight camera distortions
(``scripts/make_device_data.py``), the same ``small_cnn`` — and a textbook loop: SGD with
momentum on every device from the current global model, the plain mean of the eight models
(running statistics included), R rounds. Beside it a CNN that keeps the spatial layout
(flatten + linear head instead of global average pooling), and the centralized bound (the
pooled device data, the same optimizer, as many steps as all devices together).

    python benchmarks/fedavg_reference.py                      # ~1 min on 2 cores
    python benchmarks/fedavg_reference.py --rounds 5 --local-steps 50 --lr 0.05
    python benchmarks/fedavg_reference.py --quick    # tiny: it runs, figures mean nothing
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from make_device_data import distort  # noqa: E402

from benchmarks.harness import parse_args, verdict  # noqa: E402
from hpc_core.data import load_digits_tensors  # noqa: E402
from hpc_core.models import SmallCNN  # noqa: E402

CAMERAS = [("invert",), ("rotate",), ("blur",), ("noise",), ("invert", "noise"),
           ("rotate", "blur"), ("invert", "rotate"), ("blur", "noise")]  # federated.py's
Data = list[tuple[torch.Tensor, torch.Tensor]]


def quantized(x: torch.Tensor) -> torch.Tensor:  # as make_device_data stores it
    return torch.from_numpy((x.numpy() * 255).round().astype(np.uint8).astype(np.float32) / 255)


def make_data(test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, Data, Data]:
    """Upstream pool (clean), each device's shard through its camera, each camera's test set."""
    x, y = load_digits_tensors(16)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = round(test_fraction * len(y))
    test, pool = perm[:n_test], perm[n_test:]
    shards = np.array_split(pool, len(CAMERAS))
    devices = [(quantized(distort(x[s], list(c), seed=seed + 100 + i)), y[s])
               for i, (c, s) in enumerate(zip(CAMERAS, shards, strict=True))]
    tests = [(quantized(distort(x[test], list(c), seed=seed + 200 + i)), y[test])
             for i, c in enumerate(CAMERAS)]
    return quantized(x[pool]), y[pool], devices, tests


def conv_block(cin: int, cout: int) -> nn.Sequential:  # small_cnn's block, BatchNorm
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


def model(arch: str) -> nn.Module:
    if arch == "small_cnn":
        return SmallCNN(10, 1, width=16, norm="batch")
    w = 16  # small_cnn's blocks, spatial layout kept to the head
    return nn.Sequential(conv_block(1, w), conv_block(w, 2 * w), nn.MaxPool2d(2),
                         conv_block(2 * w, 4 * w), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * w * 16, 10))


def train(m: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
          seed: int, *, adamw: bool = False, batch: int = 16) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    opt = (torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0) if adamw
           else torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
    m.train()
    for _ in range(steps):
        idx = torch.randint(len(y), (batch,), generator=g)
        loss = F.cross_entropy(m(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


def union_accuracy(m: nn.Module, tests: Data) -> float:
    m.eval()
    with torch.no_grad():
        return float(np.mean([(m(x).argmax(1) == y).float().mean() for x, y in tests]))


def mean_model(models: list[nn.Module]) -> nn.Module:
    out = copy.deepcopy(models[0])
    state = out.state_dict()
    for k, v in state.items():
        if v.is_floating_point():
            state[k] = sum(m.state_dict()[k] for m in models) / len(models)
    out.load_state_dict(state)
    return out


def run(arch: str, args: argparse.Namespace, data: tuple) -> dict[str, float | list[float]]:
    px, py, devices, tests = data
    torch.manual_seed(args.seed)
    base = train(model(arch), px, py, args.upstream_steps, 3e-3, args.seed, adamw=True)
    pooled_x = torch.cat([d[0] for d in devices])
    pooled_y = torch.cat([d[1] for d in devices])
    total = args.local_steps * args.rounds * len(devices)
    central = train(copy.deepcopy(base), pooled_x, pooled_y, total, args.lr, args.seed)
    local = [union_accuracy(train(copy.deepcopy(base), x, y, args.local_steps, args.lr, i), tests)
             for i, (x, y) in enumerate(devices)]
    rounds, g = [], base
    for r in range(args.rounds):
        g = mean_model([train(copy.deepcopy(g), x, y, args.local_steps, args.lr, i + 10 * r)
                        for i, (x, y) in enumerate(devices)])
        rounds.append(union_accuracy(g, tests))
    return {"base": union_accuracy(base, tests), "centralized": union_accuracy(central, tests),
            "local_best": max(local), "fedavg": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-steps", type=int, default=50, help="SGD steps a device a round")
    p.add_argument("--lr", type=float, default=0.05, help="device SGD (momentum 0.9) lr")
    p.add_argument("--upstream-steps", type=int, default=900, help="AdamW 3e-3, batch 16")
    p.add_argument("--archs", default="small_cnn,flatten-head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of the digits held out as every camera's test images")
    args = parse_args(p, {"rounds": 1, "local_steps": 2, "upstream_steps": 10,
                          "test_fraction": 0.03})
    data = make_data(args.test_fraction, args.seed)
    print(f"{'model':14} {'base':>6} {'best local':>10} {'central':>8} {'fedavg by round':>24} "
          f"{'fedavg/central':>14}")
    ratios: dict[str, float] = {}
    for arch in args.archs.split(","):
        start = time.perf_counter()
        r = run(arch, args, data)
        fed = r["fedavg"]
        assert isinstance(fed, list)
        ratios[arch] = fed[-1] / float(r["centralized"])
        print(f"{arch:14} {r['base']:6.3f} {r['local_best']:10.3f} {r['centralized']:8.3f} "
              f"{' '.join(f'{a:.3f}' for a in fed):>24} {fed[-1] / float(r['centralized']):14.2f}"
              f"  ({time.perf_counter() - start:.0f} s)")
    best = max(ratios, key=ratios.__getitem__)
    verdict(f"plain FedAvg / centralized (best model: {best}) ratio", ratios[best], ">=", 0.97,
            note="federated.py's target, outside the pipeline")


if __name__ == "__main__":
    main()
