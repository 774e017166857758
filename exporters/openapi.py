"""The OpenAPI 3 document served at /openapi.json.

It is the contract the tests hold real responses to (schemathesis checks every
documented status and body shape).  The paths are written here; every body's schema
comes from topoagent.documents.schema and topoagent.documents.agent, the modules that also write those
bodies, so a field or an enum is written once.
"""

from __future__ import annotations

from typing import Any

import topoagent
from topoagent.documents.agent import LEASE, NOFIT, PLACEMENT, component_schemas
from topoagent.documents.lease import OWNER_MAX_LEN, TTL_MAX_S, TTL_MIN_S
from topoagent.placement.request import REQUEST_LIMITS, request_json_schema
from topoagent.vocabulary import NOT_READY_FOR_PLACEMENT as NOT_READY_FOR_PLACEMENT_CODE

PLACE_LIMITS = {
    **REQUEST_LIMITS,  # the request's own, from the parser every door uses
    "owner_max_len": OWNER_MAX_LEN,  # the lease store's own: it grants nothing it would refuse to load
    "ttl_min_s": TTL_MIN_S,
    "ttl_max_s": TTL_MAX_S,
}

def _err(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(description: str, ref: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


# Every operation: a Host header naming neither an IP address nor a name this agent
# answers to ([http] allowed_hosts): what a DNS-rebinding page in a browser sends.
HOST_ERRORS = {"421": _err("The Host header names a host this agent does not answer to.")}
READ_ERRORS = {"401": _err("The agent requires a token for reads and none or a wrong one was given."), **HOST_ERRORS}
MUTATE_ERRORS = {
    "401": _err("Missing or wrong `Authorization: Bearer` token."),
    "403": _err("Mutating endpoints are off: the agent was started without a token file."),
    "429": {
        **_err("This client address made more changes than [http] rate_limit_burst at once and rate_limit_per_s after; `Retry-After` says when to try again."),
        "headers": {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer", "minimum": 1}}},
    },
    **HOST_ERRORS,
}
BODY_TIMEOUT = {"408": _err("The request body did not arrive within [http] header_timeout_s.")}

_REQUEST = request_json_schema()
PLACE_REQUEST = {
    **_REQUEST,
    "properties": {
        **_REQUEST["properties"],
        "lease": {
            "type": "string", "pattern": "^[0-9A-Za-z_-]{1,64}$",
            "description": "A dry run only: the GPUs of this lease count as free, as its holder asks (a pod's own GPUs and their bindings).",
        },
        "reserve": {
            "type": "object",
            "additionalProperties": False,
            "required": ["owner", "ttl_s"],
            "description": "Hold the answer as a lease (needs the bearer token).",
            "properties": {
                "owner": {"type": "string", "minLength": 1, "maxLength": PLACE_LIMITS["owner_max_len"], "pattern": "^[^\\x00-\\x1f\\x7f]*[^\\s\\x00-\\x1f\\x7f][^\\x00-\\x1f\\x7f]*$"},
                "ttl_s": {"type": "number", "minimum": PLACE_LIMITS["ttl_min_s"], "maximum": PLACE_LIMITS["ttl_max_s"]},
            },
        },
    },
}

# POST /place's answers around the schema module's Placement, NoFit and Lease.
RESERVED_PLACEMENT = {**PLACEMENT.json_schema(), "description": "A placement held as a lease (the request had `reserve`)."}
RESERVED_PLACEMENT["properties"] = {**RESERVED_PLACEMENT["properties"], "lease": LEASE.ref}
RESERVED_PLACEMENT["required"] = [*RESERVED_PLACEMENT["required"], "lease"]
NO_FIT_ERROR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error", "detail", "nofit"],
    "properties": {"error": {"type": "string", "enum": ["no_fit"]}, "detail": {"type": "string"}, "nofit": NOFIT.ref},
}
# POST /place with `reserve`: the lease book's last check at the grant refused a GPU the
# placement took for free (both read one rule, Holding.of and the grant's claims: a defence).
LEASE_CONFLICT_ERROR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error", "detail"],
    "properties": {"error": {"type": "string", "enum": ["lease_conflict"]}, "detail": {"type": "string"}},
}
NEVER_FITS_ERROR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error", "detail", "nofit"],
    "properties": {"error": {"type": "string", "enum": ["never_fits"]}, "detail": {"type": "string"}, "nofit": NOFIT.ref},
}

# GET /readyz's and POST /place's 503 once a topology is loaded: the findings that make
# answers untrustworthy.
FINDINGS = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "required": ["kind", "severity", "subject", "message"],
    "properties": {k: {"type": "string"} for k in ("kind", "severity", "subject", "message")},
}}
# GET /readyz, while the last discovery run failed: why, and when it runs again.
DISCOVERY_RETRY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error", "failures", "failed_at", "retry_at", "retry_in_s"],
    "properties": {
        "error": {"type": "string", "description": "why the last run failed"},
        "failures": {"type": "integer", "minimum": 1, "description": "runs failed in a row"},
        "failed_at": {"type": "number", "description": "Unix time of the last failure"},
        "retry_at": {"type": "number", "description": "Unix time of the next run"},
        "retry_in_s": {"type": "number", "minimum": 0},
    },
}
NOT_READY_FOR_PLACEMENT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error", "detail", "findings"],  # GET /readyz adds snapshot_version, stale, warnings (and discovery)
    "properties": {
        "error": {"type": "string", "enum": [NOT_READY_FOR_PLACEMENT_CODE]},
        "detail": {"type": "string"},
        "snapshot_version": {"type": "integer"},
        "stale": {"type": "boolean"},
        "findings": FINDINGS,
        "warnings": FINDINGS,
        "discovery": DISCOVERY_RETRY,
    },
}
# GET /readyz's 200, and its 503 before a topology is loaded.
READY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["status", "snapshot_version", "stale", "warnings"],
    "properties": {
        "status": {"type": "string", "enum": ["ready"]},
        "snapshot_version": {"type": "integer"},
        "stale": {"type": "boolean"},
        "warnings": {**FINDINGS, "description": "failing sources (collector-error findings): said, never a reason to refuse"},
        "discovery": DISCOVERY_RETRY,
    },
}
NOT_READY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error", "detail"],
    "properties": {"error": {"type": "string", "enum": ["not_ready"]}, "detail": {"type": "string"}, "discovery": DISCOVERY_RETRY},
}


def openapi_document() -> dict[str, Any]:
    not_ready = {"503": _err("No topology loaded yet.")}
    state_unavailable = {
        **_err("`state_unavailable`: the lease state directory (named in `detail`) cannot be written; nothing was changed."),
        "headers": {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer", "minimum": 1}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "topoagent",
            "version": topoagent.__version__,
            "description": "GPU topology, placement and leases of one node.",
        },
        "components": {
            "schemas": {**component_schemas(), "PlaceRequest": PLACE_REQUEST, "ReservedPlacement": RESERVED_PLACEMENT, "NoFitError": NO_FIT_ERROR, "NeverFitsError": NEVER_FITS_ERROR,
                        "LeaseConflictError": LEASE_CONFLICT_ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            "/topology": {
                "get": {
                    "summary": "The node's topology (JSON), or nvidia-smi-style text with ?format=matrix.",
                    "parameters": [
                        {"name": "format", "in": "query", "required": False, "schema": {"type": "string", "enum": ["json", "matrix"]}},
                        {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}},
                    ],
                    "responses": {
                        "200": {
                            "description": "The current snapshot; `agent.stale` is true when the last discovery failed.",
                            "headers": {"ETag": {"schema": {"type": "string"}}},
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Topology"}}, "text/plain": {"schema": {"type": "string"}}},
                        },
                        "304": {"description": "Unchanged since the ETag given in If-None-Match."},
                        "400": _err("Unknown format, a query parameter other than format, or format given twice."),
                        **READ_ERRORS,
                        **not_ready,
                    },
                }
            },
            "/capacity": {
                "get": {
                    "summary": "What this node can take now: free GPUs, the largest free zone (NVLink or one PCIe switch), fragmentation, and for each k whether k GPUs fit and how well.",
                    "parameters": [{"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}}],
                    "responses": {
                        "200": {**_json("The figures for the current snapshot and busy GPUs (or, with `stale` true, the latest computed while "
                                        "the current ones still were, sent without an ETag and with `Cache-Control: no-store`: see docs/http-api.md).", "Capacity"), "headers": {"ETag": {"schema": {"type": "string"}}}},
                        "304": {"description": "Unchanged since the ETag given in If-None-Match."},
                        **READ_ERRORS,
                        "503": {
                            "description": "No topology loaded yet (`not_ready`); the first capacity figures are still being computed "
                                           "(`capacity_pending`, `Retry-After`); or a critical finding makes placement answers "
                                           "untrustworthy (`not_ready_for_placement`, as POST /place: which, and why).",
                            "content": {"application/json": {"schema": {"oneOf": [{"$ref": "#/components/schemas/Error"}, NOT_READY_FOR_PLACEMENT]}}},
                        },
                    },
                }
            },
            "/place": {
                "post": {
                    "operationId": "place",
                    "summary": "Which GPUs a job should get (dry run), or reserve them as a lease.",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PlaceRequest"}}}},
                    "security": [{}, {"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "The placement, lean (the GPUs in rank order, the objective, `proven_optimal`, the reasons by "
                                           "code) with the sections the request's `detail` names; with `lease` when the request had `reserve`.",
                            "content": {"application/json": {"schema": {"oneOf": [PLACEMENT.ref, {"$ref": "#/components/schemas/ReservedPlacement"}]}}},
                            "links": {"ReleaseLease": {"operationId": "releaseLease", "parameters": {"lease_id": "$response.body#/lease/id"}}},
                        },
                        "400": _err("Malformed JSON or a bad field; `detail` names it."),
                        **BODY_TIMEOUT,
                        **MUTATE_ERRORS,
                        "409": {
                            "description": "It does not fit now (busy or leased GPUs; `no_fit`: `nofit` says why, `never_fits` is false); "
                                           "or, with `reserve`, the lease book holds one of the GPUs placed (`lease_conflict`: "
                                           "`detail` names the GPU, its owner and lease).",
                            "content": {"application/json": {"schema": {"oneOf": [{"$ref": "#/components/schemas/NoFitError"},
                                                                                  {"$ref": "#/components/schemas/LeaseConflictError"}]}}},
                        },
                        "422": _json(
                            "It would not fit this node with every GPU free either (the same search on the idle node): "
                            "waiting or preempting will not help; `nofit` says why, `never_fits` is true.", "NeverFitsError"),
                        "413": _err("Body larger than the limit."),
                        "503": {"description": "No topology loaded yet (`not_ready`); a critical finding makes every answer "
                                "untrustworthy (`not_ready_for_placement`, as GET /readyz says); or, with `reserve`, "
                                + state_unavailable["description"], "headers": state_unavailable["headers"],
                                "content": {"application/json": {"schema": {"oneOf": [{"$ref": "#/components/schemas/Error"},
                                                                                      NOT_READY_FOR_PLACEMENT]}}}},
                    },
                }
            },
            "/leases": {
                "get": {
                    "summary": "Leases currently held.",
                    "responses": {
                        "200": {
                            "description": "Active leases, oldest first.",
                            "content": {"application/json": {"schema": {"type": "object", "required": ["leases", "orphaned"], "properties": {
                                "leases": {"type": "array", "items": {"$ref": "#/components/schemas/Lease"}},
                                "orphaned": {"type": "array", "items": {"type": "string"}, "description": "Ids of leases one of whose GPUs left the node (found by UUID): they hold the ones left."},
                                "recovered_from_corrupt_state": {
                                    "type": "object",
                                    "required": ["file", "moved_to", "error"],
                                    "description": "Present only when the state file was unreadable at start-up: it was moved aside and the agent started with no leases.",
                                    "properties": {"file": {"type": "string"}, "moved_to": {"type": "string"}, "error": {"type": ["string", "null"]}},
                                },
                                "quarantined": {
                                    "type": "object",
                                    "required": ["file", "entries"],
                                    "description": "Present only when the state file had entries the agent refused: each is kept in `file`, and the GPUs it named stay held by the lease `held_by` (owner topoagent-quarantine).",
                                    "properties": {"file": {"type": "string"}, "unreadable": {"type": "string", "description": "Present only when the quarantine file cannot be read (a FIFO, a link, a directory in its place): why. Its records are not shown; the GPUs they named stay held."}, "entries": {"type": "array", "items": {"type": "object", "properties": {
                                        "quarantined_at": {"type": ["number", "null"]}, "error": {"type": ["string", "null"]},
                                        "held_by": {"type": ["string", "null"]}, "gpus": {"type": ["array", "null"], "items": {"type": "integer"}},
                                    }}}},
                                },
                            }}}},
                        },
                        **READ_ERRORS,
                    },
                }
            },
            "/leases/{lease_id}": {
                "delete": {
                    "operationId": "releaseLease",
                    "summary": "Release a lease.",
                    "parameters": [{"name": "lease_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "security": [{"bearer": []}],
                    "responses": {"200": _json("The released lease.", "Lease"), **MUTATE_ERRORS, "404": _err("No such lease."), "503": state_unavailable},
                }
            },
            "/refresh": {
                "post": {
                    "summary": "Re-discover the node now; answers when the run ends.",
                    "security": [{"bearer": []}],
                    "requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object", "additionalProperties": False, "properties": {}}}}},
                    "responses": {
                        "200": {"description": "The snapshot after the run.", "content": {"application/json": {"schema": {"type": "object"}}}},
                        "400": _err("A body that is not a JSON object, or one with fields (it takes none); `detail` names them."),
                        **BODY_TIMEOUT,
                        **MUTATE_ERRORS,
                        "413": _err("Body larger than the limit."),
                        **not_ready,
                    },
                }
            },
            "/probe": {
                "post": {
                    "summary": "Measure every GPU pair and GPU now (busy GPUs and the duty-cycle cap overridden); answers at once, the figures reach /topology and /metrics as each target finishes.",
                    "security": [{"bearer": []}],
                    "responses": {
                        "202": {
                            "description": "The round is scheduled: the backend and the targets, in the order they run.",
                            "content": {"application/json": {"schema": {
                                "type": "object",
                                "required": ["backend", "forced", "targets"],
                                "properties": {"backend": {"type": "string", "enum": ["cuda", "cpu"]}, "forced": {"type": "boolean"}, "targets": {"type": "array", "items": {"type": "string"}}},
                            }}},
                        },
                        **MUTATE_ERRORS,
                        "409": _err("Probes are off on this agent (`probes_off`), or a probe round is still running (`probe_running`)."),
                        **not_ready,
                    },
                }
            },
            "/": {
                "get": {
                    "summary": "A picture of the node: an HTML page with an SVG of sockets, PCIe switches, GPUs, NICs and links (measured bandwidth when probed).",
                    "parameters": [{"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}}],
                    "responses": {
                        "200": {"description": "The page.", "headers": {"ETag": {"schema": {"type": "string"}}}, "content": {"text/html": {"schema": {"type": "string"}}}},
                        "304": {"description": "Unchanged since the ETag given in If-None-Match."},
                        **READ_ERRORS,
                        **not_ready,
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus text exposition.",
                    "responses": {"200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}, **READ_ERRORS},
                }
            },
            "/healthz": {"get": {"summary": "The process is alive.", "responses": {"200": {"description": "Alive.", "content": {"application/json": {"schema": {"type": "object"}}}}, **HOST_ERRORS}}},
            "/readyz": {
                "get": {
                    "summary": "Ready for placement: a topology is loaded and no finding makes its answers untrustworthy.",
                    "responses": {
                        "200": {"description": "Ready; `warnings` names failing sources, `discovery` a failing discovery (the facts are older).",
                                "content": {"application/json": {"schema": READY}}},
                        "503": {
                            "description": "No topology loaded yet (`not_ready`; `discovery` says why the last run failed and when "
                                           "the next runs), or one is loaded but a critical finding "
                                           "makes placement answers untrustworthy (`not_ready_for_placement`: which, and why).",
                            "content": {"application/json": {"schema": {"oneOf": [NOT_READY, NOT_READY_FOR_PLACEMENT]}}},
                        },
                        **HOST_ERRORS,
                    },
                }
            },
            "/openapi.json": {"get": {"summary": "This document.", "responses": {"200": {"description": "OpenAPI 3.1.", "content": {"application/json": {"schema": {"type": "object"}}}}, **HOST_ERRORS}}},
        },
    }
