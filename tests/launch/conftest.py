"""A real single-node Slurm cluster (munged + slurmctld + slurmd) for the launch tests.

Started as root from Debian's slurm-wlm and munge packages with a private slurm.conf (this
host's name, CPUs and memory as ``slurmd -C`` reports them), private munge socket, free ports
and a throwaway state folder; every daemon is stopped afterwards, also when a test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> str:
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
        return p.stdout

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_state(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s}s: {info}")

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).strip()

    def release_requeued(self, job_id: str, timeout_s: float) -> None:
        """Let a requeued job start now rather than at the BeginTime Slurm gave it, once a
        restart is as safe as Slurm's own delay makes it. slurmd rejects a launch whose
        credential is not newer, in whole seconds, than the previous run's revoke ("Job 1
        already killed, do not launch batch job"; the job then fails with no output at all),
        and a revoke that reached slurmd after the new launch would kill the new run. So: wait
        until the node has finished the previous run (idle, no slurmstepd of the job left),
        then start at the next second."""
        deadline = time.monotonic() + timeout_s
        step_sockets = f"spool/{self.node}_{job_id}.*"  # slurmstepd's, one per step
        while True:
            state, steps = self.node_state(), sorted(self.root.glob(step_sockets))
            if state == "idle" and not steps:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node} {state!r}, steps {steps} after {timeout_s}s")
            time.sleep(0.2)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+1")

    def log_since(self, daemon: str, since: str, last: int = 40) -> str:
        """The last lines of slurmctld.log or slurmd.log written from ``since`` on (a local
        ISO time stamp, as the logs write theirs)."""
        path = self.root / f"{daemon}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join([ln for ln in lines if ln[1:20] >= since][-last:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line() -> tuple[str, str]:
    """``NodeName=<host> CPUs=... RealMemory=...`` as slurmd detects this machine."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    line = out.splitlines()[0]
    fields = dict(kv.split("=", 1) for kv in line.split())
    return fields["NodeName"], line + " NodeAddr=127.0.0.1 State=UNKNOWN"


def _write_conf(root: Path, node: str, node_line: str) -> Path:
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=edgetrain-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
# No cgroups or accounting daemons in a test container: track processes by parent pid.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Schedule every second (default 60 s): a requeued job should not wait a minute to restart.
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
{node_line}
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def _stop(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {missing}): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a test Slurm cluster needs root (slurmd launches jobs as their user)")
    if not Path("/etc/munge/munge.key").exists():
        pytest.skip("no /etc/munge/munge.key: reinstall munge (its postinst creates the key)")
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    root.chmod(0o755)
    for d in ("state", "spool", "jobs"):
        (root / d).mkdir()
    (root / "munge").mkdir(mode=0o711)
    node, node_line = _node_line()
    conf = _write_conf(root, node, node_line)
    cluster = SlurmCluster(root, conf, node)
    try:
        m = root / "munge"
        subprocess.run(
            ["munged", "--force", f"--socket={m}/munge.sock", f"--pid-file={m}/munged.pid",
             f"--log-file={m}/munged.log", f"--seed-file={m}/seed",
             "--key-file=/etc/munge/munge.key"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        for daemon in ("slurmctld", "slurmd"):
            p = subprocess.run(
                [daemon, "-f", str(conf)], capture_output=True, text=True, timeout=30
            )
            if p.returncode != 0:
                pytest.skip(f"{daemon} did not start: {p.stderr.strip()}")
        deadline = time.monotonic() + 30
        while "idle" not in cluster.run("sinfo", "-h", "-o", "%T", check=False):
            if time.monotonic() > deadline:
                log = (root / "slurmd.log").read_text()[-1500:]
                pytest.skip(f"the Slurm node never became idle: {log}")
            time.sleep(0.3)
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "-u", "root"], env=cluster.env,
                       capture_output=True, timeout=30)  # fmt: skip
        _stop(root / "slurmd.pid")
        _stop(root / "slurmctld.pid")
        _stop(root / "munge" / "munged.pid")
        shutil.rmtree(root, ignore_errors=True)
