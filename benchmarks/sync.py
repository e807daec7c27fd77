"""Registry sync benchmark: pull throughput vs curl, delta bytes, bytes re-moved after a cut.

One run, side by side, over loopback HTTP (the test suite's Range-capable server, in its own
process so it does not share a GIL with the client):

1. throughput: ``curl`` fetching exactly the manifest, signature and chunk URLs of a version
   (one connection, and --parallel like our pool), vs ``agent.storage.update.pull`` (fetch +
   sha256 of every chunk into the chunk store), and pull + install into an A/B slot;
2. delta: after v1 is installed, pull v2 that changes 10% of the layers; bytes on the wire
   (the server's counter) over the bytes of a full pull;
3. resume: cut the connection at 40% of a fresh pull (clean close, then a hard reset) and count
   the bytes the server had to send again;
4. slow retrieval: how long a server that drips 1 byte per second holds ``agentctl pull``
   (target: the configured --deadline-s + 10%);
5. memory: peak RSS of an ``agentctl pull`` process of the whole checkpoint (target: <= 128 MB),
   beside the same process doing nothing but importing what a pull imports, and of its whole
   process tree (target: <= 128 MB too: the registered model's spec is checked torch-free, in
   process). Beside it the same pull of the same tensors under a custom factory's name
   (``--allow-custom-model``), whose spec check still needs a torch child: what every pull's
   tree cost before the check went torch-free.

    python benchmarks/sync.py                 # 256 MB checkpoint
    python benchmarks/sync.py --size-mb 32    # quicker
    python benchmarks/sync.py --quick         # a few seconds: it runs, its figures mean nothing
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.storage.chunk_store import ChunkStore  # noqa: E402
from agent.storage.slots import ModelSlots  # noqa: E402
from agent.storage.spec_check import check_model_spec  # noqa: E402
from agent.storage.update import pull, update  # noqa: E402
from benchmarks.harness import parse_args, verdict  # noqa: E402
from hpc_core.checkpoint import save_checkpoint  # noqa: E402
from hpc_core.config import config_from_dict  # noqa: E402
from hpc_core.model_spec import read_checkpoint  # noqa: E402
from hpc_core.models import build_model  # noqa: E402
from registry.chunks import DEFAULT_CHUNK_SIZE  # noqa: E402
from registry.errors import FetchFailedError  # noqa: E402
from registry.manifest import Manifest  # noqa: E402
from registry.names import chunk_key  # noqa: E402
from registry.publish import publish_content  # noqa: E402
from registry.refs import parse_ref  # noqa: E402
from registry.signing import generate_keypair, load_signing_key, load_trusted_keys  # noqa: E402
from registry.stores import LocalStore  # noqa: E402
from registry.transfer import TransferConfig  # noqa: E402

MB = 1e6
CUSTOM_FACTORY = "tests.agent.storage.custom_model:build"
"""The benchmark's MLP under a custom factory's name (the agentctl child runs in REPO)."""


def model_spec(size_mb: float) -> dict:
    """An MLP of equal hidden layers whose weights add up to ~size_mb (at least 20 layers, so
    10% of them is a whole number of layers)."""
    layers = max(20, round(size_mb / 4.194304) + 1)
    width = max(64, round(math.sqrt(size_mb * MB / 4 / layers) / 64) * 64)
    return {"name": "mlp", "kwargs": {"hidden": [width] * layers}, "num_classes": 10,
            "in_channels": 1, "image_size": 8}


def make_versions(work: Path, spec: dict) -> tuple[Path, Path]:
    torch.manual_seed(0)
    m = build_model(spec["name"], num_classes=10, in_channels=1, image_size=8, **spec["kwargs"])
    cfg = config_from_dict({"model": spec, "training": {"max_steps": 1}}).to_dict()
    v1 = save_checkpoint(work / "v1", model_state=m.state_dict(),
                         trainer_state={"step": 1, "epoch": 0, "config": cfg, "metrics": {}})
    # v2: 10% of the hidden layers (weight and bias) changed, as a fine-tune of a few layers.
    m2 = copy.deepcopy(m)
    layers = len(spec["kwargs"]["hidden"])
    linear = [mod for mod in m2 if isinstance(mod, torch.nn.Linear)]
    with torch.no_grad():
        for mod in linear[1 : 1 + layers // 10]:
            mod.weight.mul_(1.01)
            mod.bias.add_(0.01)
    v2 = save_checkpoint(work / "v2", model_state=m2.state_dict(),
                         trainer_state={"step": 2, "epoch": 0, "config": cfg, "metrics": {}})
    return v1, v2


class Server:
    """tests/support/registry_server.py, run as its own process."""

    def __init__(self, root: Path) -> None:
        script = REPO / "tests" / "support" / "registry_server.py"
        self.proc = subprocess.Popen([sys.executable, str(script), "--root", str(root)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def _call(self, path: str, method: str = "GET") -> dict:
        req = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(req) as resp:
            body = resp.read()
        return json.loads(body) if body else {}

    def reset(self) -> None:
        self._call("/__reset__", "POST")

    def served(self) -> int:
        return int(self._call("/__stats__")["bytes_served"])

    def cut_at(self, offset: int, mode: str) -> None:
        self._call(f"/__cut__?at={offset}&mode={mode}", "POST")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def curl_fetch(server: Server, manifest: Manifest, dest: Path, parallel: int) -> float:
    """Time curl fetching the same objects a pull fetches, over reused connections."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir()
    keys = [f"{manifest.name}/{manifest.version}/manifest.json",
            f"{manifest.name}/{manifest.version}/manifest.sig"]
    keys += [chunk_key(c.sha256) for c in manifest.chunks]
    config = dest / "curl.cfg"
    config.write_text("".join(f'url = "{server.url}/{k}"\noutput = "{dest / str(i)}"\n'
                              for i, k in enumerate(keys)))
    cmd = ["curl", "--silent", "--no-progress-meter", "--fail", "--config", str(config)]
    if parallel > 1:
        cmd += ["--parallel", "--parallel-max", str(parallel)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


# ru_maxrss would report the benchmark's own high-water mark (Linux keeps it across fork and
# exec), so each process reads its own VmHWM, which starts afresh with the new address space.
# The spec-check child reports its VmHWM to the pull, which logs it (event "spec_check").
_PEAK = (
    "import json, logging, sys\n"
    "from agent.cli import build_parser, main\n"
    "child = []\n"
    "class Catch(logging.Handler):\n"
    "    def emit(self, r):\n"
    "        f = getattr(r, 'fields', {})\n"
    "        if f.get('event') == 'spec_check': child.append(f['peak_rss_bytes'])\n"
    "log = logging.getLogger('agent.storage')\n"
    "log.addHandler(Catch())\n"
    "log.setLevel(logging.INFO)\n"
    "code = main(sys.argv[2:]) if sys.argv[1] == 'pull' else 0\n"
    "if sys.argv[1] == 'imports':\n"
    "    build_parser()\n"
    "    import agent.storage.update\n"
    "hwm = [line for line in open('/proc/self/status') if line.startswith('VmHWM')][0]\n"
    "print(json.dumps({'self': int(hwm.split()[1]) * 1024, 'torch': 'torch' in sys.modules,\n"
    "                  'child': child[0] if child else None}), flush=True)\n"
    "sys.exit(code)\n"
)


def _tree_rss(root: int) -> int:
    """Summed VmRSS of ``root`` and every descendant, right now (0 once it is gone)."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(status.split("VmRSS:")[1].split()[0]) * 1024
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


@dataclass
class PullRun:
    wall_s: float
    code: int
    peak_rss: int
    """VmHWM of the agentctl process itself (exact)."""
    torch_imported: bool
    child_rss: int | None
    """VmHWM of the spec-check child, as it reported it (None: no child ran)."""
    tree_rss: int
    """Highest summed RSS of the process tree, sampled every ~2 ms (a lower bound)."""


def agentctl_pull(url: str, ref: str, state: Path, trusted: Path, *extra: str) -> PullRun:
    """Run ``agentctl pull`` in its own process, sampling its process tree's memory."""
    cmd = [sys.executable, "-c", _PEAK, "pull", "pull", ref, "--registry", url, "--state-dir",
           str(state), "--trusted-keys", str(trusted), "--no-progress", *extra]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: nothing can block on it
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
        tree = 0
        while proc.poll() is None:
            tree = max(tree, _tree_rss(proc.pid))
            time.sleep(0.002)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    try:
        peaks = json.loads(text.splitlines()[-1])
    except (IndexError, ValueError):
        sys.exit(f"agentctl pull printed no figures (exit {proc.returncode}):\n{text}")
    return PullRun(wall, proc.returncode, peaks["self"], peaks["torch"], peaks["child"], tree)


def imports_rss() -> int:
    """Peak RSS of a process that only imports what ``agentctl pull`` imports (torch is not
    among them: the spec check runs in a child process)."""
    done = subprocess.run([sys.executable, "-c", _PEAK, "imports"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout.splitlines()[-1])["self"])


def slow_server_hold(registry: Path, trusted: Path, work: Path, deadline_s: float) -> tuple[
        float, float, int]:
    """(seconds in-process pull() is held, seconds the agentctl process is held, its exit code)
    by an in-process server that drips 1 byte per second."""
    from tests.support.registry_server import RegistryServer

    with RegistryServer(registry) as slow:
        slow.drip_bytes_per_s = 1.0
        cfg = TransferConfig(request_deadline_s=deadline_s, free_disk_margin_bytes=0)
        t0 = time.perf_counter()
        with contextlib.suppress(FetchFailedError):  # the expected outcome; timed below
            pull(parse_ref("bench@1", slow.url), state_dir=work / "slow-a",
                 trusted=load_trusted_keys(trusted), cfg=cfg)
        held = time.perf_counter() - t0
        run = agentctl_pull(slow.url, "bench@1", work / "slow-b", trusted,
                            "--deadline-s", str(deadline_s))
    return held, run.wall_s, run.code


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=float, default=256, help="checkpoint size (default: 256)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median)")
    ap.add_argument("--connections", type=int, default=4, help="pull connections (default: 4)")
    ap.add_argument("--slow-deadline-s", type=float, default=10.0,
                    help="request deadline for the 1 B/s server (default: 10)")
    args = parse_args(ap, {"size_mb": 8.0, "repeats": 1, "slow_deadline_s": 1.0})
    if shutil.which("curl") is None:
        sys.exit("curl is missing: apt-get install -y curl")

    with tempfile.TemporaryDirectory(prefix="edgetrain-sync-") as tmp:
        work = Path(tmp)
        spec = model_spec(args.size_mb)
        v1_ckpt, v2_ckpt = make_versions(work, spec)
        # The trusted-keys folder holds public keys only: the private key lives apart.
        priv, pub = generate_keypair(work / "signing", "bench")
        (work / "keys").mkdir()
        shutil.copy(pub, work / "keys" / pub.name)
        key, trusted = load_signing_key(priv), load_trusted_keys(work / "keys")
        reg = LocalStore(work / "registry")
        m1 = publish_content(read_checkpoint(v1_ckpt), reg, name="bench", version="1",
                             key=key).manifest
        # The same tensors under a custom factory's name: only a torch child can check them.
        custom = replace(read_checkpoint(v1_ckpt), model=config_from_dict(
            {"model": {**spec, "name": CUSTOM_FACTORY}, "training": {"max_steps": 1}}).model)
        publish_content(custom, reg, name="custom", version="1", key=key)
        r2 = publish_content(read_checkpoint(v2_ckpt), reg, name="bench", version="2", key=key,
                             parent="1")
        cfg = TransferConfig(connections=args.connections, free_disk_margin_bytes=0)
        server = Server(work / "registry")
        try:
            ref1 = parse_ref("bench@1", server.url)
            state = work / "state"

            def fresh() -> None:
                if state.exists():
                    shutil.rmtree(state)

            # The spec check of a registered model is torch-free and in process (spec_check):
            # every timed pull below pays for it alike. Run once here to show it passes.
            check_model_spec(m1, (work / "registry/bench/1/manifest.json").read_bytes())

            # 1. Throughput, interleaved so background load hits every variant alike.
            times: dict[str, list[float]] = {"curl": [], "curl_par": [], "pull": [], "update": []}
            for _ in range(args.repeats):
                times["curl"].append(curl_fetch(server, m1, work / "curl", 1))
                times["curl_par"].append(curl_fetch(server, m1, work / "curl", args.connections))
                fresh()
                server.reset()
                t0 = time.perf_counter()
                pull(ref1, state_dir=state, trusted=trusted, cfg=cfg)
                times["pull"].append(time.perf_counter() - t0)
                full = server.served()
                fresh()
                t0 = time.perf_counter()
                update(ref1, state_dir=state, trusted=trusted, cfg=cfg)
                times["update"].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}

            # 2. Delta: v1 is installed (last loop); pull v2.
            server.reset()
            update(parse_ref("bench@2", server.url), state_dir=state, trusted=trusted, cfg=cfg)
            delta = server.served()
            assert ModelSlots(state, "bench").active().version == "2"  # type: ignore[union-attr]

            # 3. Resume after a cut at 40% of a fresh pull.
            removed = {}
            for mode in ("fin", "rst"):
                fresh()
                server.reset()
                server.cut_at(int(0.4 * full), mode)
                update(ref1, state_dir=state, trusted=trusted, cfg=cfg)
                removed[mode] = server.served() - full
            assert not any(ChunkStore(state).partial_dir.iterdir())

            # 5. Peak RSS of a whole pull in its own process, beside its imports alone.
            fresh()
            mem = agentctl_pull(server.url, "bench@1", state, work / "keys")
            assert mem.code == 0, "agentctl pull failed"
            fresh()
            mem_custom = agentctl_pull(server.url, "custom@1", state, work / "keys",
                                       "--allow-custom-model")
            assert mem_custom.code == 0, "agentctl pull --allow-custom-model failed"
            base_rss = imports_rss()
        finally:
            server.stop()
        # 4. Slow retrieval.
        held, held_cli, held_code = slow_server_hold(work / "registry", work / "keys", work,
                                                     args.slow_deadline_s)

    size = m1.total_bytes
    rate = {k: size / v / MB for k, v in med.items()}
    n = args.connections
    print(f"edgetrain registry sync: {size / MB:.0f} MB checkpoint ({len(m1.tensors)} tensors, "
          f"{len(m1.chunks)} chunks of <= {DEFAULT_CHUNK_SIZE >> 20} MiB), loopback HTTP, "
          f"median of {args.repeats}")
    print(f"  {'':34s} {'seconds':>8s} {'MB/s':>8s}")
    print(f"  {'curl, 1 connection':34s} {med['curl']:8.3f} {rate['curl']:8.0f}")
    print(f"  {f'curl --parallel-max {n}':34s} {med['curl_par']:8.3f} {rate['curl_par']:8.0f}")
    print(f"  {f'pull: fetch + verify ({n} conns)':34s} {med['pull']:8.3f} {rate['pull']:8.0f}")
    print(f"  {'pull + install into A/B slot':34s} {med['update']:8.3f} {rate['update']:8.0f}")
    best_curl = min(med["curl"], med["curl_par"])
    ratio = med["curl"] / med["pull"]
    print(f"  throughput pull / curl (1 conn):   {ratio:.2f}x  (target >= 1.0x)")
    print(f"  throughput pull / best curl:       {best_curl / med['pull']:.2f}x")
    print(f"  delta v1 -> v2 (10% of layers):    {delta / MB:.1f} MB of {full / MB:.1f} MB = "
          f"{100 * delta / full:.1f}% of a full pull  (target <= 12%)")
    print(f"  publishing v2 wrote {r2.bytes_written / MB:.1f} MB of new chunks, reused "
          f"{r2.bytes_reused / MB:.1f} MB")
    for mode, label in (("fin", "clean close"), ("rst", "hard reset")):
        print(f"  re-moved after a cut at 40% ({label}): {removed[mode]:,} bytes "
              f"= {removed[mode] / DEFAULT_CHUNK_SIZE:.2f} chunk  (target <= 1 chunk)")
    d = args.slow_deadline_s
    print(f"  1 B/s server holds pull():         {held:.2f} s with a {d:g} s deadline = "
          f"{held / d:.2f}x  (target <= 1.10x)")
    print(f"  ... and an agentctl pull process:  {held_cli:.2f} s = {held_cli / d:.2f}x, exit "
          f"{held_code} (interpreter start and imports included)")
    def child(run: PullRun) -> str:
        return "none ran" if run.child_rss is None else f"{run.child_rss / MB:.0f} MB peak RSS"

    print(f"  peak RSS, agentctl pull of {size / MB:.0f} MB:  {mem.peak_rss / MB:.0f} MB  "
          f"(target <= 128 MB; torch imported: {mem.torch_imported}); its imports alone: "
          f"{base_rss / MB:.0f} MB; the pull adds {(mem.peak_rss - base_rss) / MB:.0f} MB")
    print(f"  ... its spec-check child (torch):  {child(mem)} (the check is torch-free)")
    print(f"  ... the whole process tree:        {mem.tree_rss / MB:.0f} MB summed RSS at its "
          "highest, sampled every ~2 ms  (target <= 128 MB)")
    c = mem_custom
    print(f"  the same pull, custom factory:     {c.peak_rss / MB:.0f} MB, its torch child "
          f"{child(c)}, the tree {c.tree_rss / MB:.0f} MB (--allow-custom-model; every pull's "
          "tree before the check went torch-free)")
    verdict("pull / curl (1 connection) throughput ratio", ratio, ">=", 1.0, also=[
        ("delta <= 12% of a full pull", delta <= 0.12 * full),
        ("re-moved after a cut <= 1 chunk", max(removed.values()) <= DEFAULT_CHUNK_SIZE),
        ("1 B/s server held <= 1.10x the deadline", held <= 1.10 * d),
        ("agentctl pull peak RSS <= 128 MB", mem.peak_rss <= 128 * MB),
        ("its process tree <= 128 MB", mem.tree_rss <= 128 * MB)])


if __name__ == "__main__":
    main()
