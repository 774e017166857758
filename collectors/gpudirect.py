"""Whether GPUDirect RDMA's peer-memory module is loaded, checked where NCCL checks it.

NCCL's InfiniBand transport (src/transport/net_ib/gdr.cc) enables GPUDirect RDMA through
peer memory when one of these files exists; it can also use DMA-BUF, which only a verbs
call on the HCA can tell (no file says so).  So a found module is a fact we can write
(``gdr="1"`` on the NCCL file's nets), and none found means "unknown", not "off".

None found is still worth saying where we saw the kernel's module list (``/sys/module``):
then the absence is a fact (``PeerMemory(None)``), and discovery warns on a node with RDMA
NICs.  A recording without that list (made before it was read) says nothing either way.
"""

from __future__ import annotations

from topoagent.collectors.base import CollectorResult, NoData, off_loop, run_collector
from topoagent.node.facts import PeerMemory
from topoagent.node.host import Host

# The files NCCL tests, in its order, and the module each one means.
PEER_MEMORY_FILES = (
    ("/sys/kernel/mm/memory_peers/nv_mem/version", "nv_peer_mem"),
    ("/sys/kernel/mm/memory_peers/nv_mem_nc/version", "nv_peer_mem"),
    ("/sys/module/nvidia_peermem/version", "nvidia_peermem"),
)
MODULES_DIR = "/sys/module"  # every loaded module (and built-in with parameters) has a folder




def read_peer_memory(host: Host) -> tuple[PeerMemory, tuple[str, ...]]:
    """The loaded peer-memory module; ``PeerMemory(None)`` when the module list was seen
    without one; NoData when neither (nothing to say)."""
    for path, module in PEER_MEMORY_FILES:
        # Read, not just tested: a snapshot records what was read, so a replay sees it too.
        if host.read_optional(path) is not None:
            return PeerMemory(module), ()
    # Listed, not just tested: a snapshot keeps the listing, so a replay sees the absence.
    if host.listdir(MODULES_DIR):
        return PeerMemory(None), ()
    raise NoData("no GPUDirect peer-memory module loaded (nvidia_peermem, nv_peer_mem)")


async def collect(host: Host) -> CollectorResult[PeerMemory]:
    async def read() -> tuple[PeerMemory, tuple[str, ...]]:
        return await off_loop(read_peer_memory, host)

    return await run_collector("gpudirect", read)


__all__ = ["MODULES_DIR", "PEER_MEMORY_FILES", "collect", "read_peer_memory"]
