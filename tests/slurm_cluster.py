"""A real Slurm cluster on loopback for tests: Debian's munged, slurmctld and slurmd (22.05),
each a child process in the foreground, all files in one directory, stopped by ``stop()``.

    with SlurmCluster(tmp_path, [SlurmNode("gpu01")], gres_conf=text) as cluster:
        cluster.run("srun", "--gres=gpu:2", "env").stdout

Choices, and why:

- Authentication is munge with a key and socket of the cluster's own (the socket is root's
  alone).  Slurm 22.05 still has ``auth/none``, but with it any local user could run commands
  as root through the test's slurmd while a test runs.
- slurmd runs in mount and PID namespaces of its own (``unshare``).  Its /dev is a private
  copy of the host's plus the node's faked device files (``/dev/nvidiaN`` as the NVIDIA
  driver makes them, char 195:N), so the host's /dev never shows GPUs that are not there
  (our own agent on this machine would find them).  When slurmd ends, the kernel ends every
  process it started (slurmstepd, job tasks): nothing outlives ``stop()``.
- A node's CPUs may be another machine's: ``hwloc_synthetic`` goes to slurmd as hwloc's
  ``HWLOC_SYNTHETIC``, so the ``Cores=`` of a recorded 128-core node name cores slurmd has.
- ``proctrack/pgid`` and ``task/none``: no cgroups to set up (a container may have none
  writable), and the jobs a test runs need no binding enforced by the kernel.
- Only one slurmd: Debian builds Slurm without ``--enable-multiple-slurmd``.  Further nodes
  (``SlurmNode(..., slurmd=False)``) are only named in slurm.conf, e.g. for topology.conf;
  they stay DOWN/UNKNOWN.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "sinfo", "scontrol", "scancel", "squeue")
NVIDIA_MAJOR = 195  # the NVIDIA driver's character device major (/dev/nvidiaN is 195:N)

# Run by `unshare -m -p -f --mount-proc` before slurmd: a tmpfs over /dev holding the host's
# device nodes (copied) and submounts (pts, shm: bound again), plus the faked devices
# given as PATH:MAJOR:MINOR arguments up to "--"; then exec the command after "--".
_PRIVATE_DEV = r"""
set -eu
real=$1; shift
subs=$(awk '$5 ~ "^/dev/[^/]+$" { print substr($5, 6) }' /proc/self/mountinfo | sort -u)
mount --rbind /dev "$real"
mount -t tmpfs -o mode=0755,nosuid tmpfs /dev
for f in "$real"/* "$real"/.[!.]*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  name=${f##*/}
  if printf '%s\n' $subs | grep -qxF "$name"; then
    if [ -d "$f" ]; then mkdir "/dev/$name"; else : > "/dev/$name"; fi
    mount --rbind "$f" "/dev/$name"
  else
    cp -a "$f" /dev/
  fi
done
umount -l "$real"
while [ "$1" != -- ]; do
  spec=$1; shift
  path=${spec%%:*}; rest=${spec#*:}
  mkdir -p "$(dirname "$path")"
  mknod -m 0666 "$path" c "${rest%%:*}" "${rest#*:}"
done
shift
exec "$@"
"""


def require_slurm() -> None:
    """Fail when Slurm is not installed (scripts/test installs it); skip only where this
    machine cannot run it at all."""
    if os.geteuid() != 0:
        pytest.skip(reason="slurmd launches jobs only as root, and faking /dev/nvidia* needs root")
    missing = [name for name in (*DAEMONS, *CLIENTS, "unshare") if shutil.which(name) is None]
    if missing:
        raise AssertionError(f"{', '.join(missing)} not found: install Debian's slurm-wlm (scripts/test does)")
    probe = subprocess.run(["unshare", "-m", "-p", "-f", "--mount-proc", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(reason=f"no private mount and PID namespaces for slurmd here: {probe.stderr.strip()}")


@dataclass(frozen=True, slots=True)
class FakeDevice:
    path: str
    major: int
    minor: int

    def spec(self) -> str:
        return f"{self.path}:{self.major}:{self.minor}"


def gres_device_files(gres_conf: str) -> tuple[FakeDevice, ...]:
    """The ``File=/dev/nvidiaN`` of a gres.conf, as the driver's device nodes (195:N)."""
    devices = []
    for path in re.findall(r"\bFile=(\S+)", gres_conf):
        match = re.fullmatch(r"/dev/nvidia(\d+)", path)
        if match is None:
            raise ValueError(f"gres.conf File={path}: only /dev/nvidiaN is faked here")
        devices.append(FakeDevice(path, NVIDIA_MAJOR, int(match.group(1))))
    return tuple(dict.fromkeys(devices))


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str  # a node name, or a hostlist (gpu[01-16]) when slurmd=False
    # slurm.conf words for its CPUs ("CPUs=256 Sockets=2 CoresPerSocket=64 ThreadsPerCore=2");
    # None: what slurmd -C finds (with hwloc_synthetic when given)
    hardware: str | None = None
    hwloc_synthetic: str | None = None  # the CPUs slurmd sees instead of this machine's
    gres: str | None = None  # slurm.conf Gres=, e.g. "gpu:nvidia_a100-sxm4-40gb:8"
    devices: tuple[FakeDevice, ...] = ()  # device files only this node's slurmd sees
    slurmd: bool = True  # False: named in slurm.conf only, no daemon


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_hardware(hwloc_synthetic: str | None) -> str:
    """The CPU words of ``slurmd -C`` (what slurmd will find when it starts)."""
    env = dict(os.environ)
    if hwloc_synthetic is not None:
        env["HWLOC_SYNTHETIC"] = hwloc_synthetic
    done = subprocess.run(["slurmd", "-C"], env=env, capture_output=True, text=True, timeout=30, check=True)
    words = dict(w.split("=", 1) for w in done.stdout.split() if "=" in w)
    return " ".join(f"{k}={words[k]}" for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore"))


@dataclass
class _Daemon:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: IO[bytes]


class SlurmCluster:
    def __init__(self, directory: Path, nodes: Sequence[SlurmNode], *, gres_conf: str | None = None,
                 topology_conf: str | None = None, extra_conf: Sequence[str] = ()) -> None:
        require_slurm()
        if sum(node.slurmd for node in nodes) > 1:
            raise ValueError("one slurmd per machine: Debian's Slurm is built without multiple-slurmd")
        self.directory = directory
        self.nodes = tuple(nodes)
        self.etc = directory / "etc"
        self.logs = directory / "log"
        self.munge_socket = directory / "munge" / "munge.socket"
        self.slurm_conf = self.etc / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.slurm_conf))
        self._daemons: list[_Daemon] = []
        self._write(gres_conf, topology_conf, extra_conf)

    def _write(self, gres_conf: str | None, topology_conf: str | None, extra_conf: Sequence[str]) -> None:
        for sub in ("etc", "log", "state", "spool", "munge", "dev"):
            (self.directory / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        ctld_port, slurmd_port = _free_ports(2)
        d = self.directory
        lines = [
            "# A test cluster on loopback, written by tests/slurm_cluster.py",
            "ClusterName=topoagent-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "KillWait=1",
            "GresTypes=gpu",
        ]
        if topology_conf is not None:
            lines.append("TopologyPlugin=topology/tree")
            (self.etc / "topology.conf").write_text(topology_conf)
        if gres_conf is not None:
            (self.etc / "gres.conf").write_text(gres_conf)
        for node in self.nodes:
            hardware = node.hardware if node.hardware is not None else _node_hardware(node.hwloc_synthetic)
            gres = f" Gres={node.gres}" if node.gres else ""
            lines.append(f"NodeName={node.name} NodeHostname=localhost NodeAddr=127.0.0.1 {hardware}{gres} State=UNKNOWN")
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        lines.extend(extra_conf)
        self.slurm_conf.write_text("\n".join(lines) + "\n")

    # -- running -------------------------------------------------------------------------

    def _node(self) -> SlurmNode:
        for node in self.nodes:
            if node.slurmd:
                return node
        raise ValueError("no node runs a slurmd")

    def _in_node(self, node: SlurmNode, argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """argv run as the node's slurmd: its own /dev (with the faked devices) and CPUs."""
        env = dict(self.env)
        if node.hwloc_synthetic is not None:
            env["HWLOC_SYNTHETIC"] = node.hwloc_synthetic
        wrapped = ["unshare", "-m", "-p", "-f", "--mount-proc", "--kill-child",
                   "sh", "-c", _PRIVATE_DEV, "private-dev", str(self.directory / "dev"),
                   *(device.spec() for device in node.devices), "--", *argv]
        return wrapped, env

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> _Daemon:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed by stop()
        env = env or self.env
        # Own session: stop() signals the daemon's whole process group.  And the kernel kills
        # the daemon if the test process dies without stop() (killed, or pytest crashed).
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)
        daemon = _Daemon(name, list(argv), env, proc, log)
        self._daemons.append(daemon)
        return daemon

    def _wait(self, what: str, daemon: _Daemon, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if daemon.proc.poll() is not None:
                raise AssertionError(f"{daemon.name} exited ({daemon.proc.returncode}) before {what}:\n{self.log(daemon.name)[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"never saw {what} within {timeout} s:\n{self.log(daemon.name)[-3000:]}")

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        """munged, slurmctld, then slurmd; back when the slurmd's node is idle."""
        try:
            key = self.directory / "munge" / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
            munge_dir = self.directory / "munge"
            # --force: munged wants every directory above its socket open to all users,
            # and pytest's temporary directories are root's alone.
            munged = self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                                            f"--key-file={key}", f"--log-file={munge_dir / 'munged.log'}",
                                            f"--pid-file={munge_dir / 'munged.pid'}", f"--seed-file={munge_dir / 'munged.seed'}"])
            self._wait("munged's socket", munged, self.munge_socket.exists, timeout)
            self._ready(self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.slurm_conf)]), timeout)
            if any(node.slurmd for node in self.nodes):
                node = self._node()
                argv, env = self._in_node(node, ["slurmd", "-D", "-N", node.name, "-f", str(self.slurm_conf)])
                self._ready(self._spawn("slurmd", argv, env), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self, daemon: _Daemon, timeout: float, registered: int = 0) -> None:
        if daemon.name == "slurmctld":
            self._wait("slurmctld answer scontrol ping", daemon, lambda: self.run("scontrol", "ping", check=False).returncode == 0, timeout)
            if any(d.name == "slurmd" for d in self._daemons):  # a restart: the node registers again
                node = self._node().name
                self._wait(f"node {node} idle", daemon, lambda: self.node_state(node) == "idle", timeout)
        elif daemon.name == "slurmd":
            node = self._node().name
            # registered: how many times it had started before, so a restart waits for its own start
            self._wait(f"node {node} idle", daemon,
                       lambda: self.log("slurmd").count("slurmd started on") > registered and self.node_state(node) == "idle", timeout)

    def restart(self, name: str, timeout: float = 30.0) -> None:
        """Stop one daemon (slurmctld or slurmd) and start it again, as an admin does for
        changes ``scontrol reconfigure`` does not apply; back when it is ready again."""
        daemon = next(d for d in self._daemons if d.name == name)
        before = self.log("slurmd").count("slurmd started on")
        self._daemons.remove(daemon)
        _end(daemon)
        self._ready(self._spawn(name, daemon.argv, daemon.env), timeout, before)

    def stop(self) -> None:
        """Stop the daemons, last started first; slurmd's end ends its jobs (PID namespace)."""
        while self._daemons:
            _end(self._daemons.pop())

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- asking --------------------------------------------------------------------------

    def run(self, *argv: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm command (srun, sinfo, scontrol ...) against this cluster."""
        # cwd: where sbatch writes a job's slurm-N.out unless told otherwise
        done = subprocess.run(list(argv), env=self.env, cwd=self.directory, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def node_state(self, name: str) -> str:
        done = self.run("sinfo", "-h", "-N", "-n", name, "-o", "%T", check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def wait_job(self, job_id: str, timeout: float = 60.0) -> str:
        """The state a job ends in (COMPLETED, FAILED ...), polled (sbatch --wait polls slowly)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.run("scontrol", "-o", "show", "job", job_id).stdout
            state = re.search(r"JobState=(\S+)", shown)
            if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state.group(1)
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} still not done after {timeout} s:\n{self.log('slurmctld')[-3000:]}")

    def slurmd_gres(self) -> subprocess.CompletedProcess[str]:
        """``slurmd -G``: the GRES slurmd reads from slurm.conf and gres.conf, as its node
        sees them (needs no running daemon)."""
        node = self._node()
        argv, env = self._in_node(node, ["slurmd", "-G", "-N", node.name, "-f", str(self.slurm_conf)])
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    def log(self, daemon: str) -> str:
        path = self.logs / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1  # prctl(2); SIGKILL: unshare ignores SIGTERM (its --kill-child ends slurmd)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _end(daemon: _Daemon) -> None:
    if daemon.proc.poll() is None:
        _signal_group(daemon.proc, signal.SIGTERM)
        try:
            daemon.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(daemon.proc, signal.SIGKILL)
            daemon.proc.wait(timeout=10)
    daemon.log.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)


__all__ = ["FakeDevice", "SlurmCluster", "SlurmNode", "gres_device_files", "require_slurm"]
