"""What a job asks for, and the one parser every door reads a request through.

The CLI flags, ``place --batch`` lines, HTTP ``POST /place`` (and the scheduler
integrations) all build a plain object and call ``parse_request``: the same input gets
the same ``Request`` or the same ``RequestError`` (field and message) at every door.
The request's JSON Schema is built here too, from the same limits, the ``Pattern`` enum
and the level grammar, so the OpenAPI document cannot drift from the parser.

Integral floats (``4.0``) are accepted as whole numbers at every door: JSON Schema counts
them as integers, and JSON itself does not tell 4 from 4.0, so refusing them would make
the published schema accept what the parser refuses.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from topoagent.errors import TopoagentError
from topoagent.node.levels import (
    GPU_PAIR_LEVEL_HELP,
    GPU_PAIR_LEVEL_PATTERN,
    LevelError,
    LevelKind,
    LinkLevel,
    parse_gpu_pair_level,
)
from topoagent.text import cut, quoted
from topoagent.vocabulary import DETAIL_ALL, GPU_INDEX_MAX, Affinity, Detail, Pattern

REQUEST_FIELDS = (
    "gpus", "pattern", "min_level", "single_numa", "include", "exclude", "nics", "affinity", "fallback", "message_bytes",
    "deadline_ms", "detail",
)
# Bounds on what a request may ask; the same at every door and in the JSON Schema.
REQUEST_LIMITS = {
    "gpus_max": 1024,
    "gpu_index_max": GPU_INDEX_MAX,
    "nics_max": 64,
    "message_bytes_max": 1 << 40,  # 1 TiB: far above any one collective, small enough to print
    "deadline_ms_max": 60_000,  # a minute: longer is a stall, not a search
}
# The service's deadline for a request that names none ([placement] deadline_ms), and place --batch's.
SERVICE_DEADLINE_MS = 20


class RequestError(TopoagentError, ValueError):
    """A request field is invalid.  ``field`` names the request field; ``item`` is the
    position of the offending entry when the field is a list."""

    def __init__(self, field_name: str, message: str, item: int | None = None):
        self.field = field_name
        self.item = item
        self.message = message
        super().__init__(f"{self.location}: {message}")

    @property
    def location(self) -> str:
        """``include[1]`` for a list entry, else the field name: what JSON doors report."""
        return self.field if self.item is None else f"{self.field}[{self.item}]"



def _whole_number(field_name: str, value: Any, low: int, high: int, item: int | None = None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # see the module docstring: 4.0 is a whole number
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field_name, f"expected an integer, got {quoted(value)}", item)
    if not low <= value <= high:
        raise RequestError(field_name, f"must be from {low} to {high}, got {value}", item)
    return value


E = TypeVar("E", bound=enum.Enum)


def parse_word(field_name: str, words: type[E], value: Any) -> E:
    """One of an enum's words (``pattern``, ``affinity``), or RequestError listing them."""
    if isinstance(value, str):
        try:
            return words(value)
        except ValueError:
            pass
    names = ", ".join(str(w.value) for w in words)
    raise RequestError(field_name, f"expected one of {names}, got {quoted(value)}")


def parse_min_level(value: Any) -> LinkLevel:
    if isinstance(value, LinkLevel):  # built in code, not read: only its kind can be wrong
        if value.kind in (LevelKind.SELF, LevelKind.NET_SUBNET, LevelKind.NET_OTHER):
            raise RequestError("min_level", f"{value} is not a level between two GPUs of a node")
        return value
    if isinstance(value, str):
        try:
            return parse_gpu_pair_level(value)
        except LevelError:
            pass
    raise RequestError("min_level", f"expected a GPU-to-GPU link level ({GPU_PAIR_LEVEL_HELP}), got {quoted(value)}")


def _flag(field_name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(field_name, f"expected true or false, got {quoted(value)}")
    return value


def not_on_node(field_name: str, index: int, gpu_indices: Collection[int], item: int | None = None) -> RequestError:
    known = cut(", ".join(str(i) for i in sorted(gpu_indices)), 80)
    return RequestError(field_name, f"GPU {index} is not on this node (GPUs: {known})", item)


def parse_gpu_indices(field_name: str, value: Any, gpu_indices: Collection[int] | None = None) -> tuple[int, ...]:
    """A list of nvidia-smi GPU indices: whole numbers, each once, each on the node when
    ``gpu_indices`` is given.  Sorted: the order of include/exclude carries no meaning."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise RequestError(field_name, f"expected a list of GPU indices, got {quoted(value)}")
    items = list(value)
    if len(items) > REQUEST_LIMITS["gpus_max"]:
        raise RequestError(field_name, f"more than {REQUEST_LIMITS['gpus_max']} entries")
    seen: set[int] = set()
    for n, raw in enumerate(items):
        index = _whole_number(field_name, raw, 0, REQUEST_LIMITS["gpu_index_max"], n)
        if gpu_indices is not None and index not in gpu_indices:
            raise not_on_node(field_name, index, gpu_indices, n)
        if index in seen:
            raise RequestError(field_name, f"GPU {index} is listed twice", n)
        seen.add(index)
    return tuple(sorted(seen))


def parse_detail(value: Any) -> tuple[Detail, ...]:
    """The answer sections a request asks for (``detail``): a list of Detail names, or
    ``all``; each once.  In Detail's order, whatever the order asked."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise RequestError("detail", f"expected a list of section names ({_DETAIL_NAMES}), got {quoted(value)}")
    asked: set[Detail] = set()
    seen: set[str] = set()
    for n, raw in enumerate(value):
        if raw == DETAIL_ALL:
            asked.update(Detail)
        elif isinstance(raw, str) and raw in _DETAIL_VALUES:
            asked.add(Detail(raw))
        else:
            raise RequestError("detail", f"expected one of {_DETAIL_NAMES}, got {quoted(raw)}", n)
        if raw in seen:
            raise RequestError("detail", f"{raw} is listed twice", n)
        seen.add(raw)
    return tuple(d for d in Detail if d in asked)


_DETAIL_VALUES = frozenset(Detail)
_DETAIL_NAMES = ", ".join([*Detail, DETAIL_ALL])


@dataclass(frozen=True, slots=True)
class Request:
    """What a job asks for.  Construction validates (with the parser's own field rules);
    a bad field raises RequestError."""

    gpus: int
    pattern: Pattern = Pattern.ALLREDUCE
    min_level: LinkLevel | None = None  # every pair at least this close (NV = any NVLink)
    single_numa: bool = False
    include: tuple[int, ...] = ()  # nvidia-smi indices
    exclude: tuple[int, ...] = ()
    nics: int = 0
    affinity: Affinity = Affinity.ANY  # the tier the answer must meet (placement.tiers)
    fallback: bool = False  # settle for the best lower tier instead of no fit
    # The all-reduce size the estimate is for, and for alltoall and pipeline the size of one
    # message their links are timed by (placement.latency); None: the defaults.
    message_bytes: int | None = None
    deadline_ms: int | None = None  # when the search stops with its best so far; None: no limit (the door's default)
    # The answer's sections beyond the lean one (Detail): read by the rendering, never by the search.
    detail: tuple[Detail, ...] = ()

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "gpus", _whole_number("gpus", self.gpus, 1, REQUEST_LIMITS["gpus_max"]))
        put(self, "pattern", parse_word("pattern", Pattern, self.pattern))
        if self.min_level is not None:
            put(self, "min_level", parse_min_level(self.min_level))
        _flag("single_numa", self.single_numa)
        put(self, "include", parse_gpu_indices("include", self.include))
        put(self, "exclude", parse_gpu_indices("exclude", self.exclude))
        put(self, "nics", _whole_number("nics", self.nics, 0, REQUEST_LIMITS["nics_max"]))
        put(self, "affinity", parse_word("affinity", Affinity, self.affinity))
        _flag("fallback", self.fallback)
        if self.message_bytes is not None:
            put(self, "message_bytes", _whole_number("message_bytes", self.message_bytes, 1, REQUEST_LIMITS["message_bytes_max"]))
        if self.deadline_ms is not None:
            put(self, "deadline_ms", _whole_number("deadline_ms", self.deadline_ms, 1, REQUEST_LIMITS["deadline_ms_max"]))
        put(self, "detail", parse_detail(self.detail))
        if both := sorted(set(self.include) & set(self.exclude)):
            raise RequestError("include", f"GPU {both[0]} is both included and excluded")
        if len(self.include) > self.gpus:
            raise RequestError("include", f"lists {len(self.include)} GPUs but only {self.gpus} requested")

    @classmethod
    def from_json(cls, obj: Any) -> Request:
        """From a JSON object, without knowing the node (see parse_request)."""
        return parse_request(obj)


def parse_request(obj: Any, *, gpu_indices: Collection[int] | None = None) -> Request:
    """The one request parser: a JSON-like object -> Request, or RequestError naming the
    field.  Unknown keys are errors (a typo must not be ignored); ``gpu_indices``, when
    given, are the node's GPUs, and include/exclude may name no other."""
    if not isinstance(obj, Mapping):
        raise RequestError("request", "expected a JSON object")
    unknown = sorted(str(key) for key in obj if key not in REQUEST_FIELDS)
    if unknown:
        raise RequestError(unknown[0], "unknown request field")
    if "gpus" not in obj:
        raise RequestError("gpus", "required")
    fields: dict[str, Any] = {"gpus": _whole_number("gpus", obj["gpus"], 1, REQUEST_LIMITS["gpus_max"])}
    if "pattern" in obj:
        fields["pattern"] = parse_word("pattern", Pattern, obj["pattern"])
    if "min_level" in obj:  # null too is refused: the schema says a string
        fields["min_level"] = parse_min_level(obj["min_level"])
    if "single_numa" in obj:
        fields["single_numa"] = _flag("single_numa", obj["single_numa"])
    for name in ("include", "exclude"):
        if name in obj:
            fields[name] = parse_gpu_indices(name, obj[name], gpu_indices)
    if "nics" in obj:
        fields["nics"] = _whole_number("nics", obj["nics"], 0, REQUEST_LIMITS["nics_max"])
    if "affinity" in obj:
        fields["affinity"] = parse_word("affinity", Affinity, obj["affinity"])
    if "fallback" in obj:
        fields["fallback"] = _flag("fallback", obj["fallback"])
    if "message_bytes" in obj:  # null too is refused: leave it out for the default
        fields["message_bytes"] = _whole_number("message_bytes", obj["message_bytes"], 1, REQUEST_LIMITS["message_bytes_max"])
    if "deadline_ms" in obj:  # null too is refused: leave it out for the door's default
        fields["deadline_ms"] = _whole_number("deadline_ms", obj["deadline_ms"], 1, REQUEST_LIMITS["deadline_ms_max"])
    if "detail" in obj:
        fields["detail"] = parse_detail(obj["detail"])
    return Request(**fields)


def request_json_schema() -> dict[str, Any]:
    """The JSON Schema of a request object, from the parser's own limits and grammar."""
    index_list = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": REQUEST_LIMITS["gpu_index_max"]},
        "maxItems": REQUEST_LIMITS["gpus_max"],
        "uniqueItems": True,
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["gpus"],
        "properties": {
            "gpus": {"type": "integer", "minimum": 1, "maximum": REQUEST_LIMITS["gpus_max"], "description": "How many GPUs the job needs."},
            "pattern": {"type": "string", "enum": [p.value for p in Pattern], "default": Pattern.ALLREDUCE.value},
            "min_level": {"type": "string", "pattern": GPU_PAIR_LEVEL_PATTERN, "description": f"Every pair at least this close: {GPU_PAIR_LEVEL_HELP}."},
            "single_numa": {"type": "boolean", "default": False},
            "include": {**index_list, "description": "GPUs (nvidia-smi indices) the answer must contain: GPUs of this node, at most `gpus` of them, none also in `exclude` (else 400)."},
            "exclude": {**index_list, "description": "GPUs of this node the answer must not contain (an unknown index is 400)."},
            "nics": {"type": "integer", "minimum": 0, "maximum": REQUEST_LIMITS["nics_max"], "default": 0},
            "affinity": {"type": "string", "enum": [a.value for a in Affinity], "default": Affinity.ANY.value,
                         "description": "The tier the answer must meet: best (every pattern link at the node's best level, one NUMA node), "
                                        "better (no pattern link crosses the socket interconnect, one socket), any."},
            "fallback": {"type": "boolean", "default": False,
                         "description": "When `affinity` cannot be met, answer with the best lower tier (and say which) instead of no fit."},
            "message_bytes": {"type": "integer", "minimum": 1, "maximum": REQUEST_LIMITS["message_bytes_max"],
                              "description": "The all-reduce size the answer's estimate is for (default 256 MiB); for alltoall "
                                             "and pipeline also the size of one message between two ranks, which their links are "
                                             "ranked by: small-copy latency + size / bandwidth (default 1 MiB)."},
            "deadline_ms": {"type": "integer", "minimum": 1, "maximum": REQUEST_LIMITS["deadline_ms_max"],
                            "description": "When the search stops and answers with the best set found so far "
                                           "(`proven_optimal` false; default: the service's `[placement] deadline_ms`)."},
            "detail": {"type": "array", "items": {"type": "string", "enum": [*Detail, DETAIL_ALL]}, "uniqueItems": True, "default": [],
                       "description": "The answer's sections beyond the lean one (which always holds the GPUs in rank order, "
                                      "the objective, `proven_optimal` and the reasons by code): "
                                      "`bindings` (each rank's CPUs, memory node, NIC and numactl; the job's CPUs, NICs, NUMA nodes, "
                                      "numactl and environment), `launch` (torchrun wrapper, srun options, rankfile), "
                                      "`explain` (the reasons in words, the pattern's links, the estimate, the zones broken, "
                                      "the request as understood); `all`: every one. Another name is 400."},
        },
    }
