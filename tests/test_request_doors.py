"""One request parser for every door: random request objects, valid and not, sent through
`place --batch` (one real child fed every line) and HTTP POST /place (one real
`topoagent serve` on loopback, dry runs) on the same recorded node must get the same
placement JSON or the same (field, message) error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from service_helpers import DGX_A100, start_agent

from topoagent.documents.schema import SCHEMA_VERSION
from topoagent.vocabulary import Pattern

REQUESTS = 150

whole = st.integers(min_value=-3, max_value=12)
numbers = st.one_of(
    whole,
    st.sampled_from([4.0, 2.0, 0.0, 2.5, -1.0, 1024, 1025, 10**9, 10**30]),
    st.sampled_from(["4", "four", True, False, None, [2], {"n": 2}]),
)
index = st.one_of(st.integers(min_value=-1, max_value=9), st.sampled_from([3.0, 1.5, "3", None, True, 2000]))
index_list = st.one_of(
    st.lists(st.integers(min_value=0, max_value=7), max_size=4),  # mostly valid, maybe repeated
    st.lists(index, max_size=4),
    st.sampled_from(["3", 3, None, {"a": 1}]),
)
levels = st.sampled_from(
    ["NV", "nv", "NV12", "nv12", "NV18", "nV4", "NV0", "NV007", "PIX", "pix", "Pxb", "PHB", "node", "SYS", "soc",
     "X", "SELF", " PIX", "NV-1", "NET_SUBNET", "", "LOOP", 12, None, True]
)
patterns = st.one_of(st.sampled_from([p.value for p in Pattern]), st.sampled_from(["ALLREDUCE", "ring", "", 3, None]))
request_objects = st.fixed_dictionaries(
    {"gpus": st.one_of(st.integers(min_value=1, max_value=8), numbers)},
    optional={
        "pattern": patterns,
        "min_level": levels,
        "single_numa": st.one_of(st.booleans(), st.sampled_from(["yes", 1, None])),
        "include": index_list,
        "exclude": index_list,
        "nics": st.one_of(st.integers(min_value=0, max_value=4), numbers),
        "affinity": st.sampled_from(["best", "better", "any", "BEST", "good", "", 1, None, True]),
        "fallback": st.one_of(st.booleans(), st.sampled_from(["true", 0, None])),
        "message_bytes": st.one_of(
            st.integers(min_value=1, max_value=1 << 30),
            st.sampled_from([0, -1, 1 << 40, (1 << 40) + 1, 2.0**20, 1.5, "1024", None, True]),
        ),
        "deadline_ms": st.one_of(
            st.integers(min_value=1, max_value=60_000),
            st.sampled_from([0, -1, 60_001, 20.0, 2.5, "20", None, True]),
        ),
        "detail": st.one_of(
            st.lists(st.sampled_from(["bindings", "launch", "explain", "all", "numa", "", "BINDINGS", 3, None]), max_size=3),
            st.sampled_from(["bindings", "all", None, {"explain": True}]),
        ),
        "colour": st.just("red"),  # an unknown field
    },
).map(lambda obj: {k: v for k, v in obj.items() if not (k == "gpus" and v == -3)})  # -3: "gpus" left out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    agent = start_agent(tmp_path_factory.mktemp("doors"), root=DGX_A100)
    yield agent
    agent.stop()


@pytest.fixture(scope="module")
def batch():
    """One `place --batch` child for every example: it answers (and flushes) line by line."""
    child = subprocess.Popen(
        [sys.executable, "-P", "-m", "topoagent", "place", "--batch", "--root", str(DGX_A100)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    yield child
    child.stdin.close()
    assert child.wait(timeout=30) == 2  # the worst line's status: the @examples include bad input


def batch_answer(child, obj: dict) -> dict:
    child.stdin.write(json.dumps(obj) + "\n")
    child.stdin.flush()
    answer = json.loads(child.stdout.readline())
    if "error" in answer:
        assert answer.pop("schema_version") == SCHEMA_VERSION
        answer["error"].pop("line")  # which line of the stream it was: batch's own
    return answer


def http_answer(agent, obj: dict) -> dict:
    """The HTTP reply in the batch door's terms: the answer JSON, or field and message."""
    reply = agent.post("/place", obj)
    body = reply.json()
    if reply.status == 200:
        return body
    if reply.status in (409, 422):  # busy now / never fits: the answer says which, as a batch line does
        assert body["nofit"]["never_fits"] is (reply.status == 422), (obj, reply.status, body)
        return body["nofit"]
    assert reply.status == 400 and body["error"] == "bad_request", (obj, reply.status, body)
    field, _, message = body["detail"].partition(": ")
    return {"error": {"field": field, "message": message}}


@settings(max_examples=REQUESTS, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(obj=request_objects)
@example(obj={"gpus": 4.0})
@example(obj={"gpus": 2, "include": [9]})
@example(obj={"gpus": 2, "include": [1, 1], "exclude": [1]})
@example(obj={"gpus": 2, "include": [1], "exclude": [1]})
@example(obj={"gpus": 2, "min_level": "nv0"})
@example(obj={"gpus": 2, "min_level": "Soc", "pattern": "alltoall"})
@example(obj={"gpus": 10**9})
@example(obj={"gpus": 9})
@example(obj={"pattern": "ring"})
@example(obj={"gpus": 4, "affinity": "best"})
@example(obj={"gpus": 4, "affinity": "best", "fallback": True, "message_bytes": 1 << 20})
@example(obj={"gpus": 4, "detail": ["bindings", "launch", "explain"]})
@example(obj={"gpus": 9, "detail": ["all"]})  # a no fit's best answer and request, with every section
@example(obj={"gpus": 2, "detail": ["bindings", "numa"]})
def test_batch_and_http_doors_answer_alike(served, batch, obj):
    assert http_answer(served, obj) == batch_answer(batch, obj)
