"""What a lease may be: the one rule the lease store applies when it grants a lease and
again when it loads one (so it never writes what it would refuse to read), which the HTTP
door, the OpenAPI document and the cluster side quote.  Pure: no I/O, nothing of the store."""

from __future__ import annotations

import re

from topoagent.vocabulary import GPU_INDEX_MAX

TTL_MIN_S = 1  # below a float's resolution at Unix-time scale expires_at == created_at
TTL_MAX_S = 7 * 24 * 3600
OWNER_MAX_LEN = 128
UUID_MAX_LEN = 128  # NVML's are 40 characters (GPU-8-4-4-4-12)
LEASE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
# The owners the cluster side writes: a pod's ``namespace/name/uid`` (the extender and the
# device plugin, by the pod's Kubernetes UID) and a Slurm job's ``slurm-job-ID``.
POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
SLURM_JOB_OWNER = re.compile(r"slurm-job-[0-9]+")


def _shown(value: object) -> str:
    """A refused value, short: an integer of 400 digits is named by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 10_000 else 'thousands of'} digits"
    return repr(value)[:40]


def owner_problem(owner: object) -> str | None:
    """Why ``owner`` cannot own a lease, or None.  Printable text only: it is written to
    logs, metric labels and JSON, where a control, separator, bidi or surrogate code point
    forges lines, breaks the encoder or hides what it says."""
    if not isinstance(owner, str) or not 1 <= len(owner) <= OWNER_MAX_LEN:
        return f"expected a string of 1 to {OWNER_MAX_LEN} characters"
    if not owner.strip() or not owner.isprintable():
        return ("must name someone in printable text (no control, format, line or paragraph "
                "separator characters, no lone surrogates)")
    return None


def owner_pod(owner: object) -> tuple[str, str, str] | None:
    """(namespace, name, UID) of a pod's lease owner, ``namespace/name/uid``, or None for any
    other owner: the one reading of pod owners.  No pod has an empty namespace or name."""
    if not isinstance(owner, str):
        return None
    namespace, _, rest = owner.partition("/")
    name, _, uid = rest.rpartition("/")
    return (namespace, name, uid) if namespace and name and POD_UID.fullmatch(uid) else None


def owner_kind(owner: str) -> tuple[str, str, str]:
    """(kind, namespace, pod) of a lease owner: ``pod`` with the pod's namespace and name
    (``owner_pod``), ``slurm_job``, or ``other`` (any name a client chose)."""
    pod = owner_pod(owner)
    if pod is not None:
        return "pod", pod[0], pod[1]
    if SLURM_JOB_OWNER.fullmatch(owner):
        return "slurm_job", "", ""
    return "other", "", ""


def ttl_problem(ttl_s: object) -> str | None:
    """Why ``ttl_s`` cannot be a lease's TTL, or None.  Integers of any size compare
    exactly: no float conversion that could overflow."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        return "expected a number of seconds"
    if not TTL_MIN_S <= ttl_s <= TTL_MAX_S:  # NaN fails this too
        return f"must be from {TTL_MIN_S} to {TTL_MAX_S} seconds, got {_shown(ttl_s)}"
    return None


def uuid_problem(uuid: object) -> str | None:
    """Why ``uuid`` cannot be stored as a GPU's UUID in a lease, or None (None itself is
    fine: a GPU known by index only)."""
    if uuid is None:
        return None
    if not isinstance(uuid, str) or not 1 <= len(uuid) <= UUID_MAX_LEN or not uuid.isprintable():
        return f"a GPU UUID must be printable text of 1 to {UUID_MAX_LEN} characters"
    return None


def gpu_id_problem(index: int, uuid: str | None) -> str | None:
    """Why a GPU of the node, as discovery names it, can never be leased, or None: the
    store would have to write an identity it refuses to load.  An empty UUID is no UUID."""
    top = GPU_INDEX_MAX
    if not 0 <= index <= top:
        return f"its index {index} is outside 0 to {top}"
    problem = uuid_problem(uuid or None)
    return f"its UUID {_shown(uuid)} cannot be stored ({problem})" if problem else None


def lease_problem(owner: object, gpus: object, ttl_s: object, uuids: object = ()) -> str | None:
    """The one rule for a lease, used when one is granted and when one is loaded."""
    problem = owner_problem(owner)
    if problem:
        return f"owner: {problem}"
    problem = ttl_problem(ttl_s)
    if problem:
        return f"ttl_s: {problem}"
    problem = gpus_problem(gpus)
    if problem:
        return problem
    assert isinstance(gpus, (list, tuple))
    if not isinstance(uuids, (list, tuple)) or (uuids and len(uuids) != len(gpus)):
        return "gpu_uuids: expected one UUID (or null) per GPU"
    for uuid in uuids:
        problem = uuid_problem(uuid)
        if problem:
            return f"gpu_uuids: {problem}"
    named = [uuid for uuid in uuids if uuid]
    if len(set(named)) != len(named):
        return "a GPU UUID is listed twice"
    return None


def gpus_problem(gpus: object) -> str | None:
    top = GPU_INDEX_MAX
    if not isinstance(gpus, (list, tuple)) or not gpus:
        return "gpus must be a non-empty list of GPU indices"
    if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= top for g in gpus):
        return f"gpus must be GPU indices from 0 to {top}"
    if len(set(gpus)) != len(gpus):
        return "a GPU is listed twice"
    return None
