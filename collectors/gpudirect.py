"""Whether GPUDirect RDMA's peer-memory module is loaded, checked where NCCL checks it.

NCCL's InfiniBand transport (src/transport/net_ib/gdr.cc) enables GPUDirect RDMA through
peer memory when one of these files exists; it can also use DMA-BUF, which only a verbs
call on the HCA can tell (no file says so).  So a found module is a fact we can write
(``gdr="1"`` on the NCCL file's nets), and none found means "unknown", not "off".
"""

from __future__ import annotations

from topoagent.collectors.base import CollectorResult, NoData, off_loop, run_collector
from topoagent.node.host import Host

# The files NCCL tests, in its order, and the module each one means.
PEER_MEMORY_FILES = (
    ("/sys/kernel/mm/memory_peers/nv_mem/version", "nv_peer_mem"),
    ("/sys/kernel/mm/memory_peers/nv_mem_nc/version", "nv_peer_mem"),
    ("/sys/module/nvidia_peermem/version", "nvidia_peermem"),
)


def read_peer_memory(host: Host) -> tuple[str, tuple[str, ...]]:
    """The loaded peer-memory module's name; NoData when none of NCCL's files exists."""
    for path, module in PEER_MEMORY_FILES:
        # Read, not just tested: a snapshot records what was read, so a replay sees it too.
        if host.read_optional(path) is not None:
            return module, ()
    raise NoData("no GPUDirect peer-memory module loaded (nvidia_peermem, nv_peer_mem)")


async def collect(host: Host) -> CollectorResult[str]:
    async def read() -> tuple[str, tuple[str, ...]]:
        return await off_loop(read_peer_memory, host)

    return await run_collector("gpudirect", read)


__all__ = ["PEER_MEMORY_FILES", "collect", "read_peer_memory"]
