"""Slurm jobs on the node's agent: what the prolog leases, what the task prolog exports.

The pure parts of ``topoagent slurm``: Slurm's GPU ids to the agent's indices, a job's
ranks read from the agent's documents, the task prolog's ``export`` lines.  The command
(topoagent/commands/slurm.py) does the HTTP; like the rest of ``topoagent.cluster`` this
knows the agent only through its documents.

Slurm's GPU ids (``SLURM_JOB_GPUS``, ``SLURM_STEP_GPUS``) are gres indices: the position
of the GPU among the node's gres.conf lines.  ``topoagent export gres`` writes those lines
in PCI bus id order (exporters/gres.py ``bus_order``), which is also nvidia-smi's index
order on a node that has not been told otherwise; so Slurm's GPU *i* is the *i*-th of the
agent's GPUs in bus order, read from ``/topology`` the same way.  A gres.conf written by
hand in another order breaks that assumption (docs/slurm.md says so).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from topoagent.errors import TopoagentError
from topoagent.node.cpulist import CpuListError, format_cpulist, parse_cpulist
from topoagent.text import cut

OWNER_PREFIX = "slurm-job-"
# NIC and interface names as the kernel and rdma-core allow them, nothing a line of the
# task prolog's protocol could be broken by (a newline would add an export of its own).
NIC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
JOB_ID = re.compile(r"^[0-9]{1,20}$")


class SlurmJobError(TopoagentError):
    """What Slurm handed the command cannot be read (a job id, a GPU list)."""


class AgentDown(TopoagentError):
    """The agent could not be reached (no connection), or was not ready, within the deadline."""


class AgentSilent(TopoagentError):
    """The agent took the connection and answered nothing in time: it runs, but is wedged
    (its store waiting on something, say).  Not "down": what it holds is unknown, so
    ``--if-agent-down allow`` does not cover it."""


class AgentRefused(TopoagentError):
    """The agent answered, and the answer was no (409 leased, 401 token, 400 ...)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def owner_of(job_id: str) -> str:
    if not JOB_ID.match(job_id):
        raise SlurmJobError(f"SLURM_JOB_ID {cut(job_id, 40)!r} is not a Slurm job id (digits)")
    return OWNER_PREFIX + job_id


def parse_gpu_ids(name: str, text: str) -> tuple[int, ...]:
    """A Slurm GPU id list (``0,1,2,3`` or ``0-3``), ascending; () for an empty one."""
    if re.search(r"[^0-9,\s-]", text):
        raise SlurmJobError(f"{name}={cut(text, 60)!r}: expected GPU indices such as 0,1,2,3 (UUIDs and MIG devices are not supported)")
    try:
        return tuple(sorted(parse_cpulist(text)))
    except CpuListError as exc:
        raise SlurmJobError(f"{name}={cut(text, 60)!r}: {exc}") from None


def gres_order(topology: Mapping[str, Any]) -> list[int]:
    """The agent's GPU indices in Slurm's gres numbering: by PCI bus id, GPUs without one
    last by index (the order ``export gres`` writes gres.conf in)."""
    gpus = topology.get("gpus")
    if not isinstance(gpus, list):
        raise AgentRefused("GET /topology: no GPU list in the answer")
    keyed = []
    for gpu in gpus:
        index, address = (gpu.get("index"), gpu.get("address")) if isinstance(gpu, dict) else (None, None)
        if isinstance(index, bool) or not isinstance(index, int) or not (address is None or isinstance(address, str)):
            raise AgentRefused("GET /topology: a GPU without a whole-number index")
        keyed.append((address is None, address or "", index))
    return [index for _, _, index in sorted(keyed)]


def agent_indices(slurm_ids: Sequence[int], order: Sequence[int]) -> dict[int, int]:
    """Slurm GPU id -> the agent's index; SlurmJobError for an id beyond the node's GPUs."""
    out = {}
    for gpu in slurm_ids:
        if gpu >= len(order):
            raise SlurmJobError(f"Slurm's GPU {gpu} is not one of the agent's {len(order)} GPUs: "
                                "gres.conf and the agent disagree (write gres.conf with `topoagent export gres`)")
        out[gpu] = order[gpu]
    return out


def nic_ports(topology: Mapping[str, Any]) -> dict[str, int]:
    """RDMA device name -> its port to use (the first ACTIVE one, else the first)."""
    out: dict[str, int] = {}
    for nic in topology.get("nics") or []:
        if not isinstance(nic, dict) or not isinstance(nic.get("device"), str) or not NIC_NAME.match(nic["device"]):
            continue
        ports = [p for p in nic.get("ports") or [] if isinstance(p, dict) and isinstance(p.get("port"), int) and not isinstance(p.get("port"), bool)]
        active = [p for p in ports if p.get("state") == "ACTIVE"]
        if ports:
            out[nic["device"]] = (active or ports)[0]["port"]
    return out


@dataclass(frozen=True, slots=True)
class RankBinding:
    """One rank of the job on this node, as the agent placed it."""

    rank: int
    index: int  # the agent's (nvidia-smi) index
    slurm_gpu: int  # Slurm's gres index of the same GPU
    cpus: frozenset[int] | None  # None: the agent did not say
    memory_node: int | None
    nic: str | None  # an RDMA device name (mlx5_4), None when the rank has none
    nic_port: int | None

    def document(self) -> dict[str, Any]:
        return {"rank": self.rank, "index": self.index, "slurm_gpu": self.slurm_gpu,
                "cpus": None if self.cpus is None else format_cpulist(self.cpus),
                "memory_node": self.memory_node, "nic": self.nic, "nic_port": self.nic_port}


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def ranks_of(answer: Mapping[str, Any], slurm_of: Mapping[int, int], ports: Mapping[str, int]) -> list[RankBinding]:
    """The placement answer's GPUs as RankBindings in rank order.  ``slurm_of``: agent
    index -> Slurm id; ``ports``: what ``nic_ports`` read from /topology."""
    placed = answer.get("gpus")
    if not isinstance(placed, list) or not placed:
        raise AgentRefused("POST /place: the answer names no GPUs")
    out = []
    for rank, gpu in enumerate(placed):
        index = _whole(gpu.get("index")) if isinstance(gpu, dict) else None
        if index is None or index not in slurm_of:
            raise AgentRefused(f"POST /place: the answer's rank {rank} is not one of the job's GPUs")
        cpus = None
        if isinstance(gpu.get("cpus"), str):
            try:
                cpus = parse_cpulist(gpu["cpus"]) or None
            except CpuListError:
                cpus = None  # said as unknown rather than exported wrong
        nic = gpu.get("nic")
        # Only an RDMA device the node lists: NCCL_IB_HCA and UCX name devices, not netdevs.
        nic = nic if isinstance(nic, str) and nic in ports else None
        out.append(RankBinding(rank, index, slurm_of[index], cpus, _whole(gpu.get("memory_node")), nic,
                               ports[nic] if nic is not None else None))
    if len({r.index for r in out}) != len(out) or set(slurm_of) != {r.index for r in out}:
        raise AgentRefused("POST /place: the answer's GPUs are not exactly the job's")
    return out


def ranks_from_document(doc: Any) -> list[RankBinding]:
    """A job record's ranks (as ``RankBinding.document`` wrote them); SlurmJobError if bad."""
    if not isinstance(doc, list) or not doc:
        raise SlurmJobError("no ranks")
    out = []
    for rank, item in enumerate(doc):
        if not isinstance(item, dict):
            raise SlurmJobError(f"rank {rank}: not an object")
        index, slurm_gpu = _whole(item.get("index")), _whole(item.get("slurm_gpu"))
        if index is None or slurm_gpu is None or item.get("rank") != rank:
            raise SlurmJobError(f"rank {rank}: no index, slurm_gpu or rank")
        try:
            cpus = parse_cpulist(item["cpus"]) or None if isinstance(item.get("cpus"), str) else None
        except CpuListError as exc:
            raise SlurmJobError(f"rank {rank}: cpus: {exc}") from None
        nic, port = item.get("nic"), _whole(item.get("nic_port"))
        if nic is not None and (not isinstance(nic, str) or not NIC_NAME.match(nic) or port is None):
            raise SlurmJobError(f"rank {rank}: a NIC name or port that cannot be exported")
        out.append(RankBinding(rank, index, slurm_gpu, cpus, _whole(item.get("memory_node")), nic, port if nic else None))
    return out


# -- the task prolog -----------------------------------------------------------------------

def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's task count from ``SLURM_STEP_TASKS_PER_NODE`` (``4``, ``2(x3),1``)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d{1,6})(?:\(x(\d{1,6})\))?\s*", part)
        if match is None:
            raise SlurmJobError(f"SLURM_STEP_TASKS_PER_NODE={cut(tasks_per_node, 60)!r}: not Slurm's N or N(xM) list")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
        if len(counts) > node_id:
            return counts[node_id]
    raise SlurmJobError(f"SLURM_STEP_TASKS_PER_NODE={cut(tasks_per_node, 60)!r} names no node {node_id}")


def split_ranks(ranks: Sequence[RankBinding], tasks: int, local_id: int) -> tuple[list[RankBinding], bool]:
    """The ranks task ``local_id`` of ``tasks`` on this node drives, and whether they are
    its own share (else it is handed every rank: tasks that do not divide the GPUs share
    them all, as Slurm gives them, and are bound to none)."""
    if not 0 <= local_id < tasks:
        raise SlurmJobError(f"SLURM_LOCALID={local_id} is not one of the node's {tasks} tasks")
    if len(ranks) % tasks:
        return list(ranks), False
    share = len(ranks) // tasks
    return list(ranks[local_id * share:(local_id + 1) * share]), True


def cuda_numbering(step_gpus: Sequence[int], cuda_visible: str | None) -> dict[int, str] | None:
    """Slurm GPU id -> the value CUDA_VISIBLE_DEVICES names it by in this task; None when
    Slurm already gave the task only some of the step's GPUs (--gpus-per-task, --gpu-bind).

    Slurm writes CUDA_VISIBLE_DEVICES from the same ascending list as SLURM_STEP_GPUS: the
    ids themselves, or 0..n-1 where cgroups hide the other devices; pairing them by position
    keeps whichever numbering Slurm chose."""
    if cuda_visible is None:
        return {gpu: str(gpu) for gpu in step_gpus}
    values = [v.strip() for v in cuda_visible.split(",") if v.strip()]
    if len(values) != len(step_gpus) or not all(v.isdigit() for v in values):
        return None
    return dict(zip(sorted(step_gpus), values))


def cpu_mask(cpus: frozenset[int]) -> str:
    return hex(sum(1 << cpu for cpu in cpus))


def task_exports(ranks: Sequence[RankBinding], cuda_of: Mapping[int, str], bound: bool, lease: str | None) -> list[tuple[str, str]]:
    """The task's environment, as (name, value) in the order printed: its GPUs in rank
    order, and when ``bound`` (the task has its own share) their CPUs, memory nodes and NICs."""
    env = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),  # nvidia-smi's (and Slurm's) order is the bus's
           ("CUDA_VISIBLE_DEVICES", ",".join(cuda_of[r.slurm_gpu] for r in ranks)),
           ("TOPOAGENT_GPUS", ",".join(str(r.index) for r in ranks))]
    if lease:
        env.append(("TOPOAGENT_LEASE", lease))
    if not bound:
        return env
    if all(r.cpus is not None for r in ranks):
        cpus = [r.cpus for r in ranks if r.cpus is not None]
        env.append(("TOPOAGENT_CPUS", format_cpulist(frozenset().union(*cpus))))
        # For a launch inside this task (a batch script's srun, one task per GPU).
        env.append(("TOPOAGENT_CPU_BIND", "mask_cpu:" + ",".join(cpu_mask(c) for c in cpus)))
    nodes = list(dict.fromkeys(r.memory_node for r in ranks if r.memory_node is not None))
    if nodes and len(nodes) == len({r.memory_node for r in ranks}):
        env.append(("TOPOAGENT_MEMORY_NODES", ",".join(map(str, nodes))))
    nics = list(dict.fromkeys((r.nic, r.nic_port) for r in ranks if r.nic is not None))
    if nics:
        env.append(("NCCL_IB_HCA", "=" + ",".join(nic for nic, _ in nics)))  # '=': exact names, mlx5_1 is not mlx5_10
        env.append(("UCX_NET_DEVICES", ",".join(f"{nic}:{port}" for nic, port in nics)))
    return env


def export_lines(env: Sequence[tuple[str, str]]) -> str:
    """TaskProlog's stdout protocol: ``export NAME=value``, one a line, value to line's end."""
    for name, value in env:
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) or re.search(r"[\x00-\x1f\x7f]", value):
            raise ValueError(f"cannot export {name!r}")  # a bug: every value here was checked
    return "".join(f"export {name}={value}\n" for name, value in env)


# -- the health check ------------------------------------------------------------------------

DRAIN_PREFIX = "topoagent:"  # the reason our drains carry: only such a drain is ours to resume
MAX_REASON = 200


def critical_reason(topology: Any) -> str | None:
    """The drain reason for the agent's critical findings (``topoagent: <kind>: <message>``,
    one line, cut), or None when there is none.  A document that is not a topology is
    AgentRefused: a node is never resumed on an answer that says nothing."""
    findings = topology.get("findings") if isinstance(topology, dict) else None
    if not isinstance(findings, list):
        raise AgentRefused("GET /topology: no finding list in the answer")
    critical = [f for f in findings if isinstance(f, dict) and f.get("severity") == "critical"]
    if not critical:
        return None
    first = critical[0]
    kind, message = str(first.get("kind") or "critical"), str(first.get("message") or "")
    more = f" (+{len(critical) - 1} more)" if len(critical) > 1 else ""
    text = " ".join(f"{DRAIN_PREFIX} {kind}{more}: {message}".split())  # one line: scontrol keeps it as given
    return cut(text, MAX_REASON)


def health_action(reason: str | None, state: str, current_reason: str) -> tuple[str, str] | None:
    """What the health check does to the node: ("drain", reason), ("resume", ""), or None.

    ``state`` is sinfo's long state (``idle``, ``drained``, ``draining``, ``mixed`` ...);
    ``current_reason`` the node's reason now.  A node someone else drained stays as it is,
    whichever way the findings go: it is only ever resumed from a drain of ours."""
    drained = state.rstrip("*~#!%$@^-").startswith("drain")
    ours = current_reason.startswith(DRAIN_PREFIX)
    if reason is not None:
        if drained and (not ours or current_reason == reason):
            return None
        return ("drain", reason)
    if drained and ours:
        return ("resume", "")
    return None


__all__ = [
    "DRAIN_PREFIX", "OWNER_PREFIX", "AgentDown", "AgentRefused", "AgentSilent", "RankBinding", "SlurmJobError", "agent_indices",
    "critical_reason", "cuda_numbering", "export_lines", "gres_order", "health_action", "nic_ports", "owner_of", "parse_gpu_ids", "ranks_from_document",
    "ranks_of", "split_ranks", "task_exports", "tasks_on_node",
]
