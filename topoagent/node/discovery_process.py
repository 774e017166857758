"""Discovery in a child process, so a timeout really ends it.

A read stuck in the kernel (a wedged device, a replayed FIFO) or a parser chewing on a
poisoned file cannot be interrupted inside the agent's process: a thread can only be
abandoned, and it keeps its memory and its place in the thread count for good.  A child
process is killed and reaped instead, and its memory is capped by the kernel, so the
agent's own size does not depend on what the node (or a recording) holds.

Run as ``python -m topoagent.node.discovery_process ROOT``: it discovers ROOT and writes the
pickled NodeTopology on stdout, or one line ``Type: message`` on stderr and exits 1.  The
agent starts it so (``topoagent.child``), with its own topoagent, from a checkout too.
"""

from __future__ import annotations

import asyncio
import pickle
import resource
import sys

from topoagent.child import module_command
from topoagent.errors import TopoagentError
from topoagent.node.host import Host
from topoagent.node.model import NodeTopology

# The child's data limit (heap, anonymous maps and thread stacks; RLIMIT_DATA).  A
# discovery of the 16-GPU DGX-2 recording peaks at 26 MB RSS; a gigabyte leaves room for
# nodes far bigger, and stops a poisoned recording long before the node notices.
MEMORY_LIMIT_BYTES = 1 << 30
# What the parent takes back on stdout: the pickled 16-GPU DGX-2 is 63 KB.
MAX_RESULT_BYTES = 64 << 20

class DiscoveryFailed(TopoagentError):
    """The child reported an error, ran out of memory or was killed; the message says which."""


async def discover_in_child(host: Host) -> NodeTopology:
    """Discover ``host`` in a child process; cancelling this (a timeout) kills the child."""
    root = "/" if host.live else str(host.root)
    process = await asyncio.create_subprocess_exec(
        *module_command(__name__, root),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await process.communicate()
    finally:
        if process.returncode is None:  # cancelled (timed out, or the agent is stopping)
            process.kill()
            await process.wait()
    returncode = process.returncode or 0
    if returncode < 0:  # the kernel's OOM killer, or someone else's kill
        raise DiscoveryFailed(f"discovery process killed by signal {-returncode}")
    if returncode > 0:
        lines = err.decode("utf-8", errors="replace").strip().splitlines()
        raise DiscoveryFailed(lines[-1][:500] if lines else f"discovery process exited {returncode}")
    if len(out) > MAX_RESULT_BYTES:
        raise DiscoveryFailed(f"discovery result larger than {MAX_RESULT_BYTES >> 20} MiB")
    # The bytes come from our own child pickling our own NodeTopology: the recording's
    # contents are strings inside it, never code.
    node = pickle.loads(out)
    if not isinstance(node, NodeTopology):
        raise DiscoveryFailed(f"discovery process answered {type(node).__name__}, not a topology")
    return node


def main(argv: list[str]) -> int:
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    from topoagent.node.discovery import discover

    try:
        with Host(argv[0]) as host:
            node = asyncio.run(discover(host))
        data = pickle.dumps(node, protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:
        print(f"MemoryError: discovery needed more than {limit >> 20} MiB; the node's files are not what a node holds", file=sys.stderr)
        return 1
    except Exception as exc:  # one line for the agent's log and the stale snapshot's error
        notes = "; ".join(getattr(exc, "__notes__", []))
        line = f"{type(exc).__name__}: {exc}" + (f" ({notes})" if notes else "")
        print(line.replace("\n", " "), file=sys.stderr)
        return 1
    sys.stdout.buffer.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
