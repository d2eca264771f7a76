"""A real two-node Slurm on this machine, for tests: munged, slurmctld and two slurmd.

Node ``n1`` is this machine's network (address 10.231.0.1, the host's end of a veth pair);
node ``n2`` is a network namespace of its own (10.231.0.2, the other end), and each slurmd
runs in mount and UTS namespaces of its own: hostname ``n1``/``n2``, an ``/etc/hosts`` naming
both nodes. ``n2`` has private tmpfs mounts over ``/dev/shm`` and ``/tmp`` (node-local
disk and shared memory), so what one node leaves there the other does not see; everything
else (the repository, the virtual environment, ``shared``: a directory outside /tmp) is one
filesystem, as a cluster's shared filesystem is. ``node_path`` reads a node's own view.

Daemons run in the foreground as children of this process, with every file (slurm.conf,
munge key and socket, state, spool and logs) in one directory under /var/tmp; ``stop``
cancels every job, stops the daemons, kills whatever a step left and deletes the namespace.
``skip_reason`` says why a machine cannot run it (not root, no Slurm or munge, no namespaces).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["KILL_WAIT", "NODES", "SlurmCluster", "free_port", "skip_reason"]

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue",
            "ip", "unshare", "nsenter", "mount")  # fmt: skip
HOST_IP, NODE_IP = "10.231.0.1", "10.231.0.2"
NODES = ("n1", "n2")
DAEMONS = ("slurmd", "slurmctld", "slurmscriptd", "munged")
# Slurm's KillWait: seconds between SIGTERM and SIGKILL of a job's steps. Slurm's default (and
# what the docs tell users to expect); at 5 s a drain on a loaded 2-core machine was cut off
# (a service's log without "stopped"). It costs nothing when the services drain in time.
KILL_WAIT = 30


def skip_reason(*shared: Path) -> str | None:
    """Why this machine cannot run the cluster, or None when it can; ``shared``: paths both
    nodes must see (not under /tmp, which is node-local)."""
    for path in shared:
        if Path(path).resolve().is_relative_to("/tmp"):
            return f"{path} is under /tmp, which is node-local on the test cluster"
    if os.geteuid() != 0:
        return "a real Slurm needs root (slurmd, network and mount namespaces)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"not installed: {' '.join(missing)} (apt-get install slurm-wlm munge iproute2)"
    name = f"dsprobe{os.getpid()}"
    try:
        probe = subprocess.run(
            f"ip netns add {name} && ip netns exec {name} unshare --mount --uts true",
            shell=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if probe.returncode != 0:
        return f"network/mount/UTS namespaces not permitted here: {probe.stderr.strip()}"
    return None


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, ctld_port: int, slurmd_port: int, first_job: int) -> str:
    return f"""\
ClusterName=dstest
FirstJobId={first_job}
SlurmctldHost=dsctl({HOST_IP})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT}
MinJobAge=600
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
OverTimeLimit=0
SchedulerParameters=sched_interval=1
NodeName=n1 NodeHostname=n1 NodeAddr={HOST_IP} CPUs=4 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr={NODE_IP} CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged, slurmctld and the slurmd of n1 and n2; ``start`` then ``stop`` (always)."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.root = Path(tempfile.mkdtemp(prefix="dsslurm-", dir="/var/tmp"))
        self.shared = self.root / "shared"  # both nodes see it: the "parallel filesystem"
        self.conf = self.root / "slurm.conf"
        self.netns, self.veth = f"dsslurm{tag}", f"dsv{tag}"
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "USER": self.user}
        for v in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if v != "SLURM_CONF":
                del self.env[v]
        self._procs: dict[str, subprocess.Popen] = {}

    # --- start and stop -------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        """Bring up every daemon; both nodes idle within ``timeout`` seconds, or RuntimeError
        with the daemons' logs."""
        root = self.root
        for d in ("state", "spool/n1", "spool/n2", "shared"):
            (root / d).mkdir(parents=True)
        # job ids of their own: Slurm's and our files named after them never meet an earlier run's
        first_job = 10000 + int.from_bytes(os.urandom(3)) % 900000
        self.conf.write_text(_slurm_conf(root, free_port(), free_port(), first_job))
        (root / "hosts").write_text(f"127.0.0.1 localhost\n{HOST_IP} n1 dsctl\n{NODE_IP} n2\n")
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._run(f"ip netns add {self.netns}",
                  f"ip link add {self.veth}a type veth peer name {self.veth}b",
                  f"ip link set {self.veth}b netns {self.netns}",
                  f"ip addr add {HOST_IP}/30 dev {self.veth}a", f"ip link set {self.veth}a up",
                  f"ip netns exec {self.netns} ip addr add {NODE_IP}/30 dev {self.veth}b",
                  f"ip netns exec {self.netns} ip link set {self.veth}b up",
                  f"ip netns exec {self.netns} ip link set lo up")  # fmt: skip
        self._spawn("munged", [
            "munged", "-F", "-f", f"--key-file={key}", f"--socket={root}/munge.sock",
            f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        ])  # fmt: skip
        self._wait(lambda: (root / "munge.sock").exists(), 20, "munged made no socket")
        conf = ["-f", str(self.conf)]
        self._spawn("slurmctld", self._in_namespaces("dsctl", "", ["slurmctld", "-D", *conf]))
        self._spawn("n1", self._in_namespaces("n1", "", ["slurmd", "-D", "-N", "n1", *conf]))
        private = "mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm && "
        private += "mount -t tmpfs -o size=1g,mode=1777 tmpfs /tmp && "
        # nsenter, not `ip netns exec`, which mounts a new /sys (no cgroup tree: slurmd stops)
        n2 = self._in_namespaces("n2", private, ["slurmd", "-D", "-N", "n2", *conf])
        self._spawn("n2", ["nsenter", f"--net=/run/netns/{self.netns}", *n2])
        self._wait(self._idle, timeout, "the nodes never became idle")

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what any step left, delete the namespace
        and this cluster's directory. Safe to call after a failed or partial ``start``."""
        if "slurmctld" in self._procs:
            subprocess.run(["scancel", "--full", "--user", self.user], env=self.env,
                           capture_output=True, timeout=30)  # fmt: skip
            with contextlib.suppress(RuntimeError):
                self._wait(lambda: not self.squeue(), 3 * KILL_WAIT, "")
        for name in ("n2", "n1", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.leftover_processes():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "link", "del", f"{self.veth}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _in_namespaces(self, host: str, setup: str, cmd: list[str]) -> list[str]:
        """``cmd`` in new mount and UTS namespaces: hostname ``host``, our /etc/hosts."""
        script = f"hostname {host} && mount --bind {self.root}/hosts /etc/hosts && {setup}"
        return ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                "sh", "-c", script + 'exec "$@"', host, *cmd]  # fmt: skip

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / f"{name}.stderr", "wb") as err:
            self._procs[name] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, env=self.env
            )

    def _run(self, *commands: str) -> None:
        for command in commands:
            r = subprocess.run(command, shell=True, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{command}: {r.stderr.strip()}")

    def _idle(self) -> bool:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.logs()}")
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                           capture_output=True, text=True)  # fmt: skip
        return r.returncode == 0 and sorted(r.stdout.split()) == sorted(["idle", "idle", *NODES])

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        """The daemons' logs, for a failure's message."""
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stderr")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    # --- jobs ----------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> int:
        """Submit as a user does (``sbatch ARGS`` in ``cwd``); the job's id."""
        r = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **env}, cwd=cwd,
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {r.stderr}")
        return int(r.stdout.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...)."""
        r = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=self.env,
                           capture_output=True, text=True, check=True)  # fmt: skip
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended and left no process on any node."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        self._wait(lambda: self.job(job_id)["JobState"] in ended and not self.squeue(),
                   timeout, f"job {job_id} did not end")  # fmt: skip
        return self.job(job_id)

    def squeue(self) -> list[str]:
        """The ids of the jobs pending, running or completing."""
        r = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True,
                           text=True)  # fmt: skip
        return r.stdout.split()

    # --- what a node holds ---------------------------------------------------------------
    def node_path(self, node: str, path: str) -> Path:
        """``path`` as ``node`` sees it (through its slurmd's mount namespace)."""
        return Path(f"/proc/{self._slurmd_pid(node)}/root") / path.lstrip("/")

    def _slurmd_pid(self, node: str) -> int:
        """The slurmd of ``node`` (a child of the namespace-entering commands)."""
        return int((self.root / f"slurmd-{node}.pid").read_text())

    def leftover_processes(self, wait: float = 0) -> list[int]:
        """Processes of this cluster's jobs (SLURM_CONF is ours) other than its daemons, still
        there ``wait`` seconds on (a step's slurmstepd outlives its job by a moment)."""
        deadline = time.monotonic() + wait
        while (found := self._leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return found

    def _leftovers(self) -> list[int]:
        needle = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for p in self._procs.values()}
        found = []
        for path in glob.glob("/proc/[0-9]*/environ"):
            pid = int(path.split("/")[2])
            with contextlib.suppress(OSError), open(path, "rb") as f:
                if pid not in daemons and pid != os.getpid() and needle in f.read().split(b"\0"):
                    found.append(pid)
        return [pid for pid in found if not self._is_daemon(pid)]

    @staticmethod
    def _is_daemon(pid: int) -> bool:
        """slurmd, slurmctld (and its slurmscriptd), munged."""
        with contextlib.suppress(OSError):
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            return os.path.basename(argv0.decode()).strip(": ") in DAEMONS
        return True  # gone
