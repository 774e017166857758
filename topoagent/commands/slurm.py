"""`topoagent slurm prolog|epilog|task-prolog|health`: Slurm jobs lease their GPUs from the
agent, and a node with a critical finding is drained.

slurmd runs each verb (through a two-line wrapper script: slurm.conf's Prolog=, Epilog=,
TaskProlog= and HealthCheckProgram= take a path, no arguments).  The verbs speak to the node's
agent over HTTP only; ``health`` also runs Slurm's own ``sinfo`` and ``scontrol``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from topoagent.errors import TopoagentError
from topoagent.vocabulary import Detail

if TYPE_CHECKING:
    from topoagent.cluster.slurm import RankBinding

DEFAULT_AGENT = "http://127.0.0.1:9477"
DEFAULT_TOKEN_FILE = "/etc/topoagent/token"  # where systemd/topoagent.toml and the unit keep it
DEFAULT_STATE_DIR = "/run/topoagent/slurm"  # tmpfs: a record does not outlive the boot its job ran in
DEFAULT_TTL_S = 7 * 24 * 3600  # the agent's ceiling; the epilog ends the lease, the TTL only bounds a lost one
END_TIME_GRACE_S = 600  # past the job's end: time for Slurm's kill and the epilog
MAX_RECORD_BYTES = 4 << 20
MAX_ANSWER_BYTES = 32 << 20  # a 1024-GPU node's /topology is a few MB

VERBS = {
    "prolog": "Prolog=: lease exactly the GPUs Slurm allocated to the job (owner slurm-job-<id>)",
    "epilog": "Epilog=: release every lease the job holds on this node; succeeds when there is none",
    "task-prolog": "TaskProlog=: print the export lines that give this task its GPUs in rank order, CPUs and NICs",
    "health": "HealthCheckProgram=: drain the node while the agent reports a critical finding, resume it (only "
              "from a drain of its own) when none is left",
}

EPILOG = """\
slurm.conf (each a script: Slurm passes no arguments):
  Prolog=/etc/slurm/topoagent-prolog.sh          exec topoagent slurm prolog
  Epilog=/etc/slurm/topoagent-epilog.sh          exec topoagent slurm epilog
  TaskProlog=/etc/slurm/topoagent-task-prolog.sh exec topoagent slurm task-prolog
  PrologFlags=Alloc      the lease is taken when the job is allocated, not at its first step
  HealthCheckProgram=/etc/slurm/topoagent-health.sh  exec topoagent slurm health
  HealthCheckInterval=60

The health check drains the node (reason "topoagent: <kind>: <message>") while the agent's
/topology has a critical finding and resumes it when none is left, but only a node drained with
a reason starting "topoagent:": a drain of anyone else's stays.

Slurm's GPU ids are gres indices: gres.conf must list the node's GPUs in PCI bus order, as
`topoagent export gres` writes it. The prolog leases them with POST /place ("include": exactly
those GPUs, "detail": ["bindings"], "reserve": owner slurm-job-<id>, ttl_s the job's end when
Slurm gives it, else --ttl) and keeps the answer in --state-dir for the task prolog, which runs as the job's user.
Exit status: 0 done; 1 the GPUs are leased to someone else, the agent refused, could not be
reached (unless --if-agent-down allow), or took the connection and answered nothing in --timeout
(wedged: never allowed); 2 bad input (the job's environment, flags, token file, --state-dir).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "slurm",
        help="Slurm prolog, epilog and task prolog: jobs lease their GPUs and get their ranks' bindings",
        description="Run from slurmd: the prolog leases the GPUs Slurm allocated, the epilog releases "
                    "them, the task prolog binds each task to its ranks' GPUs, CPUs and NICs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, text in VERBS.items():
        verb = verbs.add_parser(name, help=text, description=text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        verb.add_argument("--agent", metavar="URL", default=DEFAULT_AGENT, help=f"the node's agent (default: {DEFAULT_AGENT})")
        verb.add_argument("--token-file", metavar="FILE", default=DEFAULT_TOKEN_FILE,
                          help=f"the agent's bearer token (default: {DEFAULT_TOKEN_FILE}); "
                               + ("read when the task's user may read it" if name == "task-prolog"
                                  else "read when present: /topology is open unless the agent guards reads" if name == "health"
                                  else "needed to lease and release"))
        if name == "health":
            verb.add_argument("--node", metavar="NAME", default=None,
                              help="the Slurm node to drain or resume (default: $SLURMD_NODENAME, which slurmd sets, "
                                   "else the short host name)")
        else:
            verb.add_argument("--state-dir", metavar="DIR", default=DEFAULT_STATE_DIR,
                              help=f"where the prolog keeps each job's placement for its task prolog (default: {DEFAULT_STATE_DIR})")
        verb.add_argument("--if-agent-down", choices=("fail", "allow"), default="fail",
                          help="when the agent cannot be reached in --timeout (no connection): fail (exit 1, default: Slurm drains "
                               "or requeues per its rules) or allow (one warning line, exit 0, nothing leased); an agent "
                               "that takes the connection and answers nothing is wedged, not down: always exit 1")
        verb.add_argument("--timeout", metavar="SECONDS", type=float, default=20.0,
                          help="give the agent this long, retries of a restarting or rate-limiting agent included (default: 20)")
        if name == "prolog":
            verb.add_argument("--ttl", metavar="SECONDS", type=float, default=float(DEFAULT_TTL_S),
                              help=f"the lease's lifetime when Slurm does not give the job's end time (default: {DEFAULT_TTL_S}, "
                                   "the agent's maximum; the epilog releases it when the job ends)")
        verb.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from topoagent.cluster.slurm import AgentDown, AgentRefused, AgentSilent, SlurmJobError
    from topoagent.errors import UsageError

    if not 0 < args.timeout <= 3600:
        raise UsageError("--timeout: expected seconds above 0, at most 3600")
    try:
        if args.verb == "prolog":
            return prolog(args)
        if args.verb == "epilog":
            return epilog(args)
        if args.verb == "health":
            return health(args)
        return task_prolog(args)
    except SlurmJobError as exc:
        return _fail(args, str(exc), 2)
    except AgentRefused as exc:
        return _fail(args, str(exc), 1)
    except AgentSilent as exc:  # never under --if-agent-down allow: it is not down
        return _fail(args, f"agent wedged, not down (--if-agent-down allow does not cover it): {exc}", 1)
    except AgentDown as exc:
        if args.if_agent_down == "allow":
            _say(args, f"agent unreachable, going on (--if-agent-down allow): {exc}")
            return 0
        return _fail(args, f"agent unreachable: {exc}", 1)
    except TopoagentError as exc:
        if isinstance(exc, UsageError):
            raise
        return _fail(args, str(exc), 1)


def _say(args: argparse.Namespace, message: str, to_task: bool = True) -> None:
    """One line on stderr, which slurmd logs for the prolog and epilog.  A task prolog's
    stderr reaches no one: it says the line on stdout too, as a ``print`` line, which
    Slurm writes to the task's output."""
    line = " ".join(f"topoagent slurm {args.verb}: {message}".split())  # one line, whatever the agent said
    print(line, file=sys.stderr)
    if args.verb == "task-prolog" and to_task:
        print(f"print {line}")


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    _say(args, message)
    return code


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def _whole_env(name: str) -> int:
    from topoagent.cluster.slurm import SlurmJobError

    text = (_env(name) or "0").strip()
    if not text.isdigit() or len(text) > 9:
        raise SlurmJobError(f"{name}={text[:40]!r}: expected a whole number")
    return int(text)


def _job_owner() -> tuple[str, str]:
    from topoagent.cluster.slurm import SlurmJobError, owner_of

    job_id = _env("SLURM_JOB_ID")
    if job_id is None:
        raise SlurmJobError("SLURM_JOB_ID is not set: run me from slurmd (Prolog=, Epilog=, TaskProlog=)")
    return job_id, owner_of(job_id.strip())


def _record_path(args: argparse.Namespace, job_id: str) -> Path:
    return Path(args.state_dir) / f"job-{job_id}.json"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: Any  # the JSON document, or None
    text: str  # the error's detail, for messages


class AgentHttp:
    """Requests to one agent within one deadline: a refused connection, 503 (not ready,
    disk) and 429 (rate limit) are tried again until then; other answers are returned,
    503 ``not_ready_for_placement`` among them (a broken node does not mend in a prolog)."""

    def __init__(self, url: str, token: str | None, deadline: float):
        from urllib.parse import urlsplit

        from topoagent.cluster.slurm import SlurmJobError
        from topoagent.text import cut

        target = urlsplit(url.rstrip("/"))
        if target.scheme not in ("http", "https") or not target.netloc or "@" in target.netloc:
            raise SlurmJobError(f"--agent {cut(url, 60)!r}: expected http://HOST:PORT or https://HOST:PORT, without a user name")
        self.netloc, self.base, self.tls = target.netloc, target.path, target.scheme == "https"
        self.token, self.deadline = token, deadline

    def request(self, method: str, path: str, body: Any = None) -> Answer:
        import http.client

        from topoagent.cluster.slurm import AgentDown, AgentRefused, AgentSilent
        from topoagent.commands.agent_connection import AgentConnection
        from topoagent.text import cut
        from topoagent.vocabulary import NOT_READY_FOR_PLACEMENT

        what = f"{method} {path}"
        pause = 0.05
        while True:
            failure, limited = "", False
            connection: AgentConnection | None = None
            try:
                connection = AgentConnection(self.netloc, self.deadline, tls=self.tls)
                try:
                    connection.connect()
                    headers = {"Accept": "application/json"}
                    if self.token:
                        headers["Authorization"] = f"Bearer {self.token}"
                    data = None
                    if body is not None:
                        data = json.dumps(body).encode()
                        headers["Content-Type"] = "application/json"
                    connection.request(method, self.base + path, body=data, headers=headers)
                    response = connection.getresponse()
                    raw = response.read(MAX_ANSWER_BYTES + 1)
                    retry_after = response.getheader("Retry-After")
                finally:
                    connection.close()
            except TimeoutError:
                # Connected (a TLS handshake the agent never answers included): the agent is there, silent.
                if connection is not None and connection.reached:
                    raise AgentSilent(f"{what}: {self.netloc} took the connection and answered nothing in time: "
                                      "the agent runs but is wedged; what it holds is unknown") from None
                raise AgentDown(f"{what}: no connection to {self.netloc} in time") from None
            except (OSError, http.client.HTTPException) as exc:
                failure = f"{what}: {self.netloc}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc or type(exc).__name__}"
            else:
                if len(raw) > MAX_ANSWER_BYTES:
                    raise AgentRefused(f"{what}: answer larger than {MAX_ANSWER_BYTES >> 20} MiB")
                doc: Any = None
                try:
                    doc = json.loads(raw) if raw else None
                except ValueError:
                    doc = None
                detail = doc.get("detail") or doc.get("error") if isinstance(doc, dict) else None
                text = cut(str(detail) if detail else raw.decode("utf-8", "replace").strip() or response.reason, 300)
                if isinstance(doc, dict) and doc.get("error") == NOT_READY_FOR_PLACEMENT:
                    # A 503 that will not pass by waiting (the fabric down, no GPU stack): the
                    # agent answered no, whatever --if-agent-down says; Slurm drains the node.
                    return Answer(response.status, doc, cut(f"not ready for placement: {text}", 300))
                if response.status not in (429, 503):
                    return Answer(response.status, doc, text)
                failure, limited = f"{what}: HTTP {response.status}: {text}", response.status == 429
                if retry_after and retry_after.isdigit():
                    pause = max(pause, float(retry_after))
            if time.monotonic() + pause >= self.deadline:
                if limited:  # the agent is there and said no, however politely
                    raise AgentRefused(failure, 429)
                raise AgentDown(failure)
            time.sleep(pause)  # the agent restarting, or its rate limit: try again until the deadline
            pause = min(pause * 2, 1.0)

    def json(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        from topoagent.cluster.slurm import AgentRefused

        answer = self.request(method, path, body)
        if answer.status not in ok:
            raise AgentRefused(f"{method} {path}: HTTP {answer.status}: {answer.text}", answer.status)
        return answer.body


def _agent(args: argparse.Namespace, token_needed: bool) -> AgentHttp:
    from topoagent.commands.token import read_client_token
    from topoagent.errors import UsageError

    token = None
    if token_needed:
        token = read_client_token("--token-file", args.token_file)
    else:
        with contextlib.suppress(UsageError):  # the task's user may not read root's token: reads are open
            token = read_client_token("--token-file", args.token_file)
    return AgentHttp(args.agent, token, time.monotonic() + args.timeout)


def _ttl(args: argparse.Namespace) -> float:
    """Until the job's end (and a grace) when the prolog's environment has
    SLURM_JOB_END_TIME (22.05's has not), else --ttl; never above the agent's maximum."""
    from topoagent.documents.lease import TTL_MAX_S

    ttl = args.ttl
    end = _env("SLURM_JOB_END_TIME")
    if end is not None and end.strip().isdigit():
        ttl = int(end) - time.time() + END_TIME_GRACE_S
    return max(60.0, min(float(ttl), float(TTL_MAX_S)))


def _slurm_gpus(*names: str) -> tuple[str, tuple[int, ...]] | None:
    from topoagent.cluster.slurm import parse_gpu_ids

    for name in names:
        text = _env(name)
        if text is not None:
            return name, parse_gpu_ids(name, text)
    return None


def _release_owned(agent: AgentHttp, owner: str) -> list[str]:
    """Release every lease ``owner`` holds; their ids.  One already gone is not an error."""
    from topoagent.cluster.slurm import AgentRefused

    held = agent.json("GET", "/leases")
    leases = held.get("leases") if isinstance(held, dict) else None
    if not isinstance(leases, list):
        raise AgentRefused("GET /leases: no lease list in the answer")
    released = []
    for lease in leases:
        if isinstance(lease, dict) and lease.get("owner") == owner and isinstance(lease.get("id"), str):
            agent.json("DELETE", f"/leases/{lease['id']}", ok=(200, 404))
            released.append(lease["id"])
    return released


def _placement(agent: AgentHttp, slurm_ids: tuple[int, ...], reserve: dict[str, Any] | None) -> tuple[list[RankBinding], dict[str, Any]]:
    """POST /place for exactly these Slurm GPUs (reserved when ``reserve``): the ranks and
    the answer."""
    from topoagent.cluster.slurm import AgentRefused, agent_indices, gres_order, nic_ports, ranks_of

    topology = agent.json("GET", "/topology")
    if not isinstance(topology, dict):
        raise AgentRefused("GET /topology: not a JSON object")
    to_agent = agent_indices(slurm_ids, gres_order(topology))
    # Each rank's CPUs, memory node and NIC are what the task prolog exports: ask for them.
    request: dict[str, Any] = {"gpus": len(slurm_ids), "include": sorted(to_agent.values()), "detail": [Detail.BINDINGS]}
    if reserve is not None:
        request["reserve"] = reserve
    answer = agent.request("POST", "/place", request)
    if answer.status != 200 or not isinstance(answer.body, dict):
        gpus = ",".join(str(to_agent[g]) for g in slurm_ids)
        raise AgentRefused(f"POST /place for GPUs {gpus} (Slurm's {','.join(map(str, slurm_ids))}): HTTP {answer.status}: {answer.text}",
                           answer.status)
    ranks = ranks_of(answer.body, {index: gpu for gpu, index in to_agent.items()}, nic_ports(topology))
    return ranks, answer.body


def _check_state_dir(path: Path) -> None:
    """Make the records' directory (0755: the task prolog reads it as the job's user) and
    refuse it when others may write it: a record they replace binds a task elsewhere.
    OSError, naming the fix, as the agent refuses its own state directory."""
    import errno

    from topoagent.statefile import state_dir_problem

    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    problem = state_dir_problem(path, mode="755")
    if problem:
        raise OSError(errno.EPERM, problem, str(path))


def prolog(args: argparse.Namespace) -> int:
    from topoagent.cluster.slurm import AgentRefused, SlurmJobError
    from topoagent.statefile import write_json_atomically

    job_id, owner = _job_owner()
    found = _slurm_gpus("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")
    record = _record_path(args, job_id)
    if found is None or not found[1]:
        return 0  # a job without GPUs on this node: nothing to lease
    try:  # before leasing: a record nobody else can replace, or no lease
        _check_state_dir(record.parent)
    except OSError as exc:
        raise SlurmJobError(f"--state-dir {record.parent}: {exc.strerror or exc}") from None
    agent = _agent(args, token_needed=True)
    # A requeued job runs its prolog again under the same id: what it held before is its own.
    _release_owned(agent, owner)
    ranks, answer = _placement(agent, found[1], {"owner": owner, "ttl_s": _ttl(args)})
    lease = answer.get("lease")
    lease_id = lease.get("id") if isinstance(lease, dict) and isinstance(lease.get("id"), str) else None
    if lease_id is None:
        raise AgentRefused("POST /place: granted, but the answer holds no lease")
    try:
        # 0644: the task prolog runs as the job's user.
        write_json_atomically(record, {"job_id": job_id, "owner": owner, "lease": lease_id, "ranks": [r.document() for r in ranks]}, mode=0o644)
    except OSError as exc:
        with contextlib.suppress(TopoagentError):
            agent.json("DELETE", f"/leases/{lease_id}", ok=(200, 404))  # no lease without its record
        raise AgentRefused(f"cannot write {record}: {exc.strerror or exc}; the lease was released") from None
    return 0


def epilog(args: argparse.Namespace) -> int:
    job_id, owner = _job_owner()
    with contextlib.suppress(FileNotFoundError):
        _record_path(args, job_id).unlink()
    _release_owned(_agent(args, token_needed=True), owner)
    return 0


def _read_record(path: Path, job_id: str) -> tuple[list[RankBinding], str | None] | None:
    """The prolog's record of this job, or None when there is none."""
    from topoagent.cluster.slurm import SlurmJobError, ranks_from_document
    from topoagent.smallfile import read_small_file

    try:
        raw, _ = read_small_file(path, MAX_RECORD_BYTES, follow_links=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SlurmJobError(f"{path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("job_id") != job_id:
            raise SlurmJobError("not this job's record")
        lease = doc.get("lease") if isinstance(doc.get("lease"), str) else None
        return ranks_from_document(doc.get("ranks")), lease
    except (ValueError, SlurmJobError) as exc:
        raise SlurmJobError(f"{path}: {exc}") from None


def task_prolog(args: argparse.Namespace) -> int:
    from topoagent.cluster.slurm import cuda_numbering, export_lines, split_ranks, task_exports, tasks_on_node

    job_id, _ = _job_owner()
    found = _slurm_gpus("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
    if found is None or not found[1]:
        return 0  # no GPUs in this step: nothing to say
    step_gpus = found[1]
    recorded = _read_record(_record_path(args, job_id), job_id)
    ranks: list[RankBinding] = []
    lease = None
    if recorded is not None:
        ranks, lease = recorded
        ranks = [r for r in ranks if r.slurm_gpu in step_gpus]  # a step may use part of the job's GPUs
    if len(ranks) != len(step_gpus):
        # No prolog record (no Prolog=, or the agent was down and allowed): a dry run over
        # the step's GPUs, which needs no token.
        ranks, _ = _placement(_agent(args, token_needed=False), step_gpus, None)
        lease = None
    cuda_of = cuda_numbering(step_gpus, _env("CUDA_VISIBLE_DEVICES"))
    if cuda_of is None:
        _say(args, "Slurm bound this task to some of the step's GPUs itself (--gpus-per-task, --gpu-bind): "
                   "its environment is left as Slurm set it", to_task=False)
        return 0
    tasks = tasks_on_node(_env("SLURM_STEP_TASKS_PER_NODE") or "1", _whole_env("SLURM_NODEID"))
    mine, bound = split_ranks(ranks, tasks, _whole_env("SLURM_LOCALID"))
    env = task_exports(mine, cuda_of, bound, lease)
    sys.stdout.write(export_lines(env))
    return 0


def _node_name(args: argparse.Namespace) -> str:
    import socket

    from topoagent.cluster.slurm import SlurmJobError

    name = args.node or _env("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    name = name.strip()
    # Slurm node names: host-name characters; anything else is no node scontrol should be handed.
    if not name or len(name) > 255 or not all(c.isalnum() or c in "-_." for c in name):
        raise SlurmJobError(f"node name {name[:60]!r}: expected a Slurm node name (--node, or $SLURMD_NODENAME)")
    return name


def _slurm_command(args: argparse.Namespace, *argv: str) -> str:
    """A Slurm client's stdout; AgentRefused naming it when it fails (exit 1: not bad input)."""
    import subprocess

    from topoagent.cluster.slurm import AgentRefused

    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=max(5.0, args.timeout), stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise AgentRefused(f"{argv[0]} not found: run me where Slurm's commands are on PATH") from None
    except subprocess.TimeoutExpired:
        raise AgentRefused(f"{argv[0]}: no answer in {max(5.0, args.timeout):g} s") from None
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:200]
        raise AgentRefused(f"{' '.join(argv[:3])}: exit {done.returncode}: {said}")
    return done.stdout


def health(args: argparse.Namespace) -> int:
    """Drain the node while a critical finding stands; resume it from our own drain when none does."""
    from topoagent.cluster.slurm import AgentRefused, critical_reason, health_action

    node = _node_name(args)
    reason = critical_reason(_agent(args, token_needed=False).json("GET", "/topology"))
    shown = _slurm_command(args, "sinfo", "-h", "-N", "-n", node, "-o", "%T %E").splitlines()
    if not shown or not shown[0].strip():
        raise AgentRefused(f"sinfo: Slurm knows no node {node!r} (--node, or $SLURMD_NODENAME)")
    state, _, current = shown[0].strip().partition(" ")
    current = "" if current.strip() == "none" else current.strip()
    action = health_action(reason, state, current)
    if action is None:
        return 0
    verb, why = action
    if verb == "drain":
        _slurm_command(args, "scontrol", "update", f"nodename={node}", "state=drain", f"reason={why}")
        _say(args, f"drained {node}: {why}")
    else:
        _slurm_command(args, "scontrol", "update", f"nodename={node}", "state=resume")
        _say(args, f"resumed {node}: the agent reports no critical finding (was: {current})")
    return 0
