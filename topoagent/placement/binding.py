"""One binding per rank: each placed GPU's own CPUs, memory node and NIC, and the forms
the usual launchers take them in.

CPUs.  A rank's *pool* is the CPUs of its GPU's NUMA node (from the discovered node), else
the CPU list nvidia-smi gives for the GPU.  Ranks that share a pool split it without
overlap: the pool's cores (a core's hyperthreads together, by the node's core map), in
order of their first CPU, are dealt out in contiguous runs, as even as can be (the first
ranks get one core more when the count does not divide).  Without a core map (nvidia-smi
text alone) the pool is not split: which CPUs are hyperthreads of one core is unknown, and
dealing out CPU numbers would put two ranks on the threads of the same cores (a CPU list
such as 0-47,96-143 pairs CPU n with n+96 on common x86 nodes, but nothing in the text
says so); every rank sharing the pool gets all of it, and the answer says why
(ReasonCode.CPUS_SHARED).  With more ranks than cores in one pool, its threads are dealt
out instead (siblings then part: nothing else keeps ranks apart); with more ranks than
CPUs, every rank gets the whole pool.

Memory.  A rank's memory node is its GPU's NUMA node.

NICs.  A NIC whose ports are all down is never chosen nor listed (a NIC whose port state
is unknown, as from nvidia-smi text, is kept).  Each rank gets the closest NIC to its GPU
among the job's NICs (the ``nics`` closest to the set when the request asks for some, else
all usable ones); where several are equally close, ranks take distinct ones (ranks with
fewer choices choose first), then the faster one, then the one whose ports carry less
traffic now (in steps of a tenth of the line rate, placement.live), then the lower position.

Launchers (``Launch``), all per local rank in rank order:

* ``numactl``: ``numactl --physcpubind=<the rank's CPUs> --membind=<its node>`` (PlacedGpu).
* ``torchrun_wrapper``: a POSIX sh script that runs its arguments under the rank's
  ``numactl``, picked by ``$LOCAL_RANK`` (set by torchrun for each worker): ``torchrun
  --nproc-per-node=K --no-python ./bind.sh python train.py``.
* ``srun``: ``--ntasks-per-node=K``, ``--cpu-bind=mask_cpu:<hex mask per task>`` and
  ``--gpu-bind=map_gpu:<GPU per task>`` (srun(1): masks are hexadecimal, ``0x`` allowed;
  map_gpu IDs are the node's GPU indices when devices are not constrained by cgroups, and
  relative to the job's GPUs when they are -- the job should then hold the whole node).
  ``srun_map_cpu`` is ``--cpu-bind=map_cpu:<one CPU per task>``: the first CPU of each
  rank's list, for one-thread tasks (none when ranks share a list: they would share that CPU).  CPU numbers are the OS's, as taskset's.
* ``rankfile``: Open MPI ``rank N=<host> slot=<cores>`` lines; slot lists are logical core
  indices (hwloc's Core L#, the core map's numbering), so there is none without a core map.
"""

from __future__ import annotations

from dataclasses import dataclass

from topoagent.node.cpulist import format_cpulist, parse_cpulist
from topoagent.placement.tables import Prepared, nearest_usable


@dataclass(frozen=True, slots=True)
class Share:
    """One rank's CPUs, with the forms launchers write them in (built once per pool split)."""

    cpus: frozenset[int]
    text: str  # cpulist, "48-55,176-183"
    mask: str  # hexadecimal, "0xff00..."
    first: int
    slots: str | None  # logical cores as a cpulist; None without a core map


@dataclass(frozen=True, slots=True)
class RankBinding:
    share: Share | None  # None when the GPU's CPUs are unknown
    memory_node: int | None
    nic: int | None  # position in matrix.nics

    @property
    def cpus(self) -> frozenset[int] | None:
        return None if self.share is None else self.share.cpus


@dataclass(frozen=True, slots=True)
class Launch:
    """Ready forms of the per-rank bindings for the launchers people use."""

    torchrun_wrapper: str | None
    srun: tuple[str, ...]
    srun_map_cpu: str | None
    rankfile: str | None


class BindingTables:
    """Per matrix (cached): each GPU's CPU pool as cores, and which NICs may be used."""

    def __init__(self, prep: Prepared):
        matrix = prep.matrix
        host = matrix.host
        core_of = host.core_of if host else {}
        self.core_of = core_of
        self.hostname = (host.hostname if host else None) or "localhost"
        self.pool_of: list[tuple[int, ...] | None] = []  # per GPU position: its pool's CPUs, sorted
        for g in matrix.gpus:
            cpus = None
            if host is not None and g.numa_node is not None and g.numa_node in host.numa_cpus:
                cpus = host.numa_cpus[g.numa_node]
            elif g.cpus:
                cpus = parse_cpulist(g.cpus)
            self.pool_of.append(tuple(sorted(cpus)) if cpus else None)
        self.usable = prep.usable_nics  # a NIC with every port down is no NIC
        # Per GPU: its closest kind among the usable NICs, and those NICs.
        self.nearest = prep.nearest_nics
        self._splits: dict[tuple[tuple[int, ...], int], list[Share]] = {}
        self.numactl: dict[tuple[str | None, int | None], tuple[str, ...]] = {}

    def share(self, cpus: frozenset[int]) -> Share:
        core_of = self.core_of
        slots = format_cpulist({core_of[c] for c in cpus}) if core_of and all(c in core_of for c in cpus) else None
        return Share(cpus, format_cpulist(cpus), f"0x{sum(1 << c for c in cpus):x}", min(cpus), slots)

    def shared_unsplit(self, ranks: int) -> bool:
        """Whether ``ranks`` (more than one) ranks on one pool all get the whole of it because
        no core map says which of its CPUs are one core's threads."""
        return ranks > 1 and not self.core_of

    def split(self, pool: tuple[int, ...], ranks: int) -> list[Share]:
        """``pool`` dealt out to ``ranks`` ranks (see the module docstring)."""
        key = (pool, ranks)
        got = self._splits.get(key)
        if got is None:
            cores: dict[int, list[int]] = {}
            for cpu in pool:
                # A CPU the core map does not know is a core of its own.
                cores.setdefault(self.core_of.get(cpu, -1 - cpu), []).append(cpu)
            units = sorted(cores.values(), key=min)
            if len(units) < ranks:
                units = [[cpu] for cpu in pool]
            if len(units) < ranks or not self.core_of:
                got = [self.share(frozenset(pool))] * ranks
            else:
                size, extra = divmod(len(units), ranks)
                got, start = [], 0
                for r in range(ranks):
                    end = start + size + (1 if r < extra else 0)
                    got.append(self.share(frozenset(cpu for unit in units[start:end] for cpu in unit)))
                    start = end
            self._splits[key] = got
        return got


def tables(prep: Prepared) -> BindingTables:
    got = prep.matrix.derived_cache.get("binding")
    if got is None:
        got = prep.matrix.derived_cache["binding"] = BindingTables(prep)
    return got


def bind_ranks(
    prep: Prepared, order: tuple[int, ...], job_nics: list[int], load: list[int] | None = None
) -> tuple[list[RankBinding], list[tuple[int, int]], tuple[int, ...]]:
    """The binding of each rank (GPUs at positions ``order``), given the job's NICs and
    each NIC's traffic now in steps (``load``; None: none); with the (chosen, passed over)
    NIC pairs that traffic alone decided, and the GPU indices whose ranks share their whole
    pool unsplit for want of a core map (BindingTables.shared_unsplit)."""
    t = tables(prep)
    by_pool: dict[tuple[int, ...], list[int]] = {}
    for rank, pos in enumerate(order):
        pool = t.pool_of[pos]
        if pool is not None:
            by_pool.setdefault(pool, []).append(rank)
    shares: list[Share | None] = [None] * len(order)
    unsplit: list[int] = []
    for pool, ranks in by_pool.items():
        if t.shared_unsplit(len(ranks)):
            unsplit += ranks
        for rank, share in zip(ranks, t.split(pool, len(ranks))):
            shares[rank] = share

    nearest = t.nearest if job_nics is t.usable else [nearest_usable(prep.nic_kind, pos, job_nics) for pos in range(len(t.nearest))]
    choices = [nearest[pos][1] for pos in order]
    used = dict.fromkeys(job_nics, 0)
    steps = load or [0] * len(prep.nic_rate)
    nic: list[int | None] = [None] * len(order)
    by_load: list[tuple[int, int]] = []
    for rank in sorted(range(len(order)), key=lambda r: (len(choices[r]), r)):
        if choices[rank]:
            pick = min(choices[rank], key=lambda j: (used[j], -prep.nic_rate[j], steps[j], j))
            even = [j for j in choices[rank] if (used[j], prep.nic_rate[j]) == (used[pick], prep.nic_rate[pick])]
            busiest = max(even, key=steps.__getitem__)
            if steps[busiest] > steps[pick] and (pick, busiest) not in by_load:
                by_load.append((pick, busiest))
            used[pick] += 1
            nic[rank] = pick
    gpus = prep.matrix.gpus
    shared = tuple(sorted(gpus[order[r]].index for r in unsplit))
    return [RankBinding(shares[r], gpus[pos].numa_node, nic[r]) for r, pos in enumerate(order)], by_load, shared


def rank_numactl(prep: Prepared, binding: RankBinding) -> tuple[str, ...]:
    """The rank's own numactl command (empty when neither its CPUs nor its node is known)."""
    node, share = binding.memory_node, binding.share
    key = (None if share is None else share.text, node)
    cache = tables(prep).numactl
    got = cache.get(key)
    if got is None:
        if share is not None:
            argv = ("numactl", f"--physcpubind={share.text}")
            got = (*argv, f"--membind={node}") if node is not None else argv
        elif node is not None:
            got = ("numactl", f"--cpunodebind={node}", f"--membind={node}")
        else:
            got = ()
        cache[key] = got
    return got


@dataclass(frozen=True, slots=True)
class LaunchInput:
    """What the launch forms are written from, taken from the bindings when the answer is
    built (no reference to the tables, so an answer kept does not keep them); the forms
    themselves are written only when asked (``forms``: a request's ``detail`` ``launch``)."""

    hostname: str
    gpus: tuple[int, ...]  # nvidia-smi indices, in rank order
    commands: tuple[tuple[str, ...], ...]  # each rank's numactl
    shares: tuple[Share | None, ...]

    def forms(self) -> Launch:
        k = len(self.gpus)
        commands = self.commands
        wrapper = None
        if all(commands):
            cases = "".join(f'  {r}) exec {" ".join(cmd)} "$@" ;;\n' for r, cmd in enumerate(commands))
            wrapper = (
                "#!/bin/sh\n"
                f"# bind.sh: torchrun --nproc-per-node={k} --no-python ./bind.sh python train.py ...\n"
                "# runs each local rank under its own CPUs and memory node (torchrun sets LOCAL_RANK).\n"
                'case "$LOCAL_RANK" in\n'
                f"{cases}"
                "esac\n"
                'echo "bind.sh: LOCAL_RANK=$LOCAL_RANK is not one of the placed ranks" >&2\n'
                "exit 1\n"
            )
        srun = [f"--ntasks-per-node={k}"]
        map_cpu = rankfile = None
        shares = self.shares
        if all(shares):
            known = [s for s in shares if s is not None]  # all of them; spelled out for the type checker
            srun.append("--cpu-bind=mask_cpu:" + ",".join(s.mask for s in known))
            if len({s.first for s in known}) == len(known):  # one-thread tasks never on one CPU
                map_cpu = "--cpu-bind=map_cpu:" + ",".join(str(s.first) for s in known)
            if all(s.slots for s in known):
                rankfile = "".join(f"rank {r}={self.hostname} slot={s.slots}\n" for r, s in enumerate(known))
        srun.append("--gpu-bind=map_gpu:" + ",".join(str(i) for i in self.gpus))
        return Launch(wrapper, tuple(srun), map_cpu, rankfile)


def launch_input(prep: Prepared, order: tuple[int, ...], bindings: list[RankBinding]) -> LaunchInput:
    gpus = prep.matrix.gpus
    return LaunchInput(
        tables(prep).hostname, tuple(gpus[pos].index for pos in order),
        tuple(rank_numactl(prep, b) for b in bindings), tuple(b.share for b in bindings),
    )
