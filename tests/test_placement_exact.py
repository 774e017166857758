"""place() against brute force: on every complete corpus matrix, over every subset of free
GPUs and every k, and on random matrices.  Terms (1) and (2) must equal brute force's best;
(3) and (4) too, since the search is exact for them given (1)-(2)."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest
from conftest import WITHOUT_GPU_STACK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_oracle import best_keys, edge, link_key, numa_distance, numa_key, pattern_key, satisfies

import topoagent.placement.bounds as bounds_module
import topoagent.placement.ksets as placement_module
import topoagent.placement.rings as rings_module
import topoagent.placement.tables as tables_module
from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.node.levels import NODE, PHB, PIX, PXB, SYS, LinkLevel, expected_gbps, nv
from topoagent.node.matrix import DistanceMatrix, GpuInfo, LatencyMeasurement, Measurement, NicInfo
from topoagent.placement import Live, NoFit, Placement, Request, evaluate_damage, place

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CORPUS = SHARED / "corpus" / "nvidia-smi-topo"


def corpus_matrices() -> list[tuple[str, DistanceMatrix]]:
    out = []
    for path in sorted(CORPUS.glob("*.txt")):
        try:
            matrix = DistanceMatrix.from_topo_matrix(parse_topo_matrix(path.read_text()))
        except ValueError:
            continue  # truncated pastes: some GPU pair has no level
        if matrix.size >= 2:
            out.append((path.name, matrix))
    return out


CORPUS_MATRICES = corpus_matrices()

# place() answers small cases (few k-sets) from a table of every k-set and the rest by
# branch and bound; every node here is small, so each test runs both ways.
SEARCH_PATHS = {"table": placement_module.SMALL_TABLE_SETS, "branch-and-bound": 0}


@pytest.fixture(params=list(SEARCH_PATHS))
def search_path(request):
    saved = placement_module.SMALL_TABLE_SETS
    placement_module.SMALL_TABLE_SETS = SEARCH_PATHS[request.param]
    yield request.param
    placement_module.SMALL_TABLE_SETS = saved


def test_corpus_has_the_machines_the_issue_names():
    names = " ".join(name for name, _ in CORPUS_MATRICES)
    for expected in ("dlperf-8xV100", "delos", "asus", "sglang-24966", "dgxA100", "tensorflow", "ibm-ac922"):
        assert expected in names
    assert len(CORPUS_MATRICES) >= 15


def answer_keys(matrix: DistanceMatrix, answer: Placement, cache: dict):
    pos = tuple(sorted(matrix.gpu_by_index(g.index) for g in answer.gpus))
    ck = (pos, answer.request.pattern, answer.request.message_bytes)
    if ck not in cache:
        cache[ck] = pattern_key(matrix, pos, answer.request.pattern, answer.request.message_bytes)
    pk = cache[ck]
    return pk, len({numa_key(matrix, p) for p in pos})


def check_answer(matrix, req, busy, answer, cache, live=None):
    expected = best_keys(matrix, req, busy, cache, live)
    if expected is None:
        assert isinstance(answer, NoFit), (req, busy, answer)
        return
    assert isinstance(answer, Placement), (req, busy, answer)
    pos = tuple(matrix.gpu_by_index(i) for i in answer.indices)
    # Valid: k distinct free GPUs meeting the constraints.
    assert len(set(pos)) == req.gpus
    assert not set(answer.indices) & set(busy)
    assert satisfies(matrix, pos, req)
    exp_pk, exp_distance, exp_numa, exp_nic, exp_damage, exp_live = expected
    got_pk, got_numa = answer_keys(matrix, answer, cache)
    assert got_pk == exp_pk, (req, busy, answer.indices)
    assert numa_distance(matrix, pos) == exp_distance, (req, busy, answer.indices)
    assert (answer.objective.numa_distance or 0) == exp_distance
    assert got_numa == exp_numa, (req, busy, answer.indices)
    # The rank order really delivers the reported bottleneck.
    if exp_pk is not None:
        order = list(pos)
        key = link_key(matrix, req.pattern, req.message_bytes)
        if req.pattern == "alltoall":
            pairs = list(combinations(order, 2))
        else:
            pairs = [(order[i], order[i + 1]) for i in range(len(order) - 1)]
            if req.pattern == "allreduce" and len(order) >= 3:
                pairs.append((order[-1], order[0]))
        assert min(key(a, b) for a, b in pairs) == exp_pk
        assert answer.bandwidth_gbps == round(min(edge(matrix, a, b)[0] for a, b in pairs), 2)
        if req.pattern in ("alltoall", "pipeline"):  # ranked by one message's time (placement.latency)
            assert answer.objective.link_time_us == pytest.approx(-exp_pk[0], abs=1e-3)
        else:
            assert answer.objective.link_time_us is None
    assert answer.objective.nic_cost == exp_nic
    assert answer.objective.damage == exp_damage
    assert evaluate_damage(matrix, busy, answer.indices) == exp_damage
    # Term (6): live signals decide among sets equal on (1)-(5).
    assert (answer.objective.unverified_gpus, answer.objective.nic_traffic_steps) == exp_live, (req, busy, live, answer.indices)
    assert set(answer.unverified) == {i for i in answer.indices if live is not None and i in live.unverified}


@pytest.mark.parametrize("name,matrix", CORPUS_MATRICES, ids=[n for n, _ in CORPUS_MATRICES])
def test_corpus_every_free_subset_every_k_matches_brute_force(name, matrix, search_path):
    indices = [g.index for g in matrix.gpus]
    cache: dict = {}
    for n_free in range(1, len(indices) + 1):
        for free in combinations(indices, n_free):
            busy = [i for i in indices if i not in free]
            for k in range(1, n_free + 1):
                for pattern in ("allreduce", "alltoall"):
                    req = Request(gpus=k, pattern=pattern)
                    check_answer(matrix, req, busy, place(matrix, req, busy), cache)
    # Pipelines and NIC requests on the empty node.
    for k in range(1, len(indices) + 1):
        for req in (Request(gpus=k, pattern="pipeline"), Request(gpus=k, nics=min(2, len(matrix.nics)))):
            check_answer(matrix, req, [], place(matrix, req, []), cache)


# --- random matrices ------------------------------------------------------------------

LEVEL_POOL = [nv(1), nv(2), nv(4), nv(12), PIX, PXB, PHB, NODE, SYS]


@st.composite
def random_case(draw):
    n = draw(st.integers(2, 7))
    levels = [[LinkLevel.parse("X")] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            levels[i][j] = levels[j][i] = draw(st.sampled_from(LEVEL_POOL))
    numa = [draw(st.sampled_from([0, 0, 1, 2, None])) for _ in range(n)]
    n_nics = draw(st.integers(0, 3))
    nic_levels = tuple(
        tuple(draw(st.sampled_from([PIX, PXB, NODE, SYS])) for _ in range(n_nics)) for _ in range(n)
    )
    unhealthy = draw(st.sets(st.integers(0, n - 1), max_size=2)) if draw(st.booleans()) else set()
    gpus = tuple(
        GpuInfo(
            index=i, name=f"GPU{i}", numa_node=numa[i], cpus=None if numa[i] is not None else "0-7",
            unhealthy="gpu-outside-fabric: off the fabric" if i in unhealthy else None,
        )
        for i in range(n)
    )
    # A SLIT table over NUMA nodes 0-2 where two nodes are close and one far, so fewest
    # nodes and least distance disagree (3 close nodes beat 2 far ones); sometimes none.
    slit = {}
    if draw(st.booleans()):
        far = draw(st.sampled_from([(2,), (1,), (0, 1)]))
        for a in range(3):
            for b in range(3):
                slit[(a, b)] = 10 if a == b else (32 if a in far or b in far else 12)
    expected = tuple(tuple(expected_gbps(lv) for lv in row) for row in levels)
    measured = {}
    if draw(st.booleans()):
        for i in range(n):
            for j in range(i + 1, n):
                if draw(st.booleans()):
                    measured[(i, j)] = Measurement(draw(st.sampled_from([10.0, 20.0, 24.0, 45.0])), 0.0)
    # Measured small-copy latencies (alltoall and pipeline are ranked by alpha + size / bandwidth).
    latency = {}
    if draw(st.booleans()):
        for i in range(n):
            for j in range(i + 1, n):
                if draw(st.booleans()):
                    latency[(i, j)] = LatencyMeasurement(draw(st.sampled_from([1.5, 3.0, 12.0, 40.0])), 0.0)
    matrix = DistanceMatrix(
        gpus=gpus,
        nics=tuple(
            NicInfo(
                name=f"mlx5_{j}",
                active=draw(st.sampled_from([True, True, False, None])),
                rate_gbps=draw(st.sampled_from([None, 200.0, 400.0])),
            )
            for j in range(n_nics)
        ),
        gpu_levels=tuple(tuple(r) for r in levels),
        gpu_expected_gbps=expected,
        gpu_nic_levels=nic_levels,
        measured=measured,
        measured_latency=latency,
        numa_distances=slit,
    )
    busy = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n - 1))
    live = None
    if draw(st.booleans()):  # live signals (placement.live): unverified GPUs, NIC traffic in GB/s
        live = Live(
            frozenset(draw(st.sets(st.integers(0, n - 1), max_size=3))),
            {f"mlx5_{j}": draw(st.sampled_from([0.0, 2e9, 3e9, 6e9, 20e9])) for j in range(n_nics)},
        )
    free = [i for i in range(n) if i not in busy]
    k = draw(st.integers(1, n))
    include = draw(st.lists(st.sampled_from(free), unique=True, max_size=min(2, k))) if draw(st.booleans()) else []
    exclude = draw(st.lists(st.sampled_from([i for i in free if i not in include] or [None]), unique=True, max_size=1))
    req = Request(
        gpus=k,
        pattern=draw(st.sampled_from(["allreduce", "alltoall", "pipeline", "independent"])),
        min_level=draw(st.sampled_from([None, None, "NV", "PIX", "NODE"])),
        single_numa=draw(st.booleans()),
        include=tuple(include),
        exclude=tuple(e for e in exclude if e is not None),
        nics=draw(st.integers(0, n_nics)),
        message_bytes=draw(st.sampled_from([None, 4096, 1 << 16, 1 << 28])),
    )
    return matrix, req, busy, live


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(random_case())
def test_random_matrices_match_brute_force(search_path, case):
    matrix, req, busy, live = case
    check_answer(matrix, req, busy, place(matrix, req, busy, live=live or Live()), {}, live)


# --- larger nodes: branch and bound against the exhaustive table -------------------------


def _larger_nodes():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from topoagent.placement.synthetic import irregular_mesh, nvswitch_16, tree_node

    usual = ((3, "allreduce", 0), (4, "allreduce", 2), (4, "alltoall", 0), (5, "pipeline", 1))
    # A sparse mesh, where rings and paths are scarce: what the search's ring and path
    # cuts (peeling, links a member must keep) are for, up to rings of half the node.
    sparse = ((4, "allreduce", 0), (6, "allreduce", 0), (5, "pipeline", 0), (6, "pipeline", 0))
    return [
        ("pcie-12: 2 sockets x 3 switches x 2", tree_node(2, 3, 2), usual),
        ("nv-12: 2 sockets x 2 switches x 3, NV zones of 3", tree_node(2, 2, 3, nv_zone=3, nv_links=4), usual),
        ("nvswitch-16", nvswitch_16(), usual),
        ("irregular-mesh-12: NVLink pairs with p = 0.3, 2 sockets", irregular_mesh(12, seed=3, socket_size=6), sparse),
    ]


@pytest.mark.parametrize("name,matrix,shapes", _larger_nodes(), ids=[n for n, *_ in _larger_nodes()])
def test_larger_nodes_branch_and_bound_equals_every_k_set(name, matrix, shapes):
    """Up to 16 GPUs, where brute force over orders is too slow for a test: the table of
    every k-set (each with its exact best order) judges branch and bound on random busy
    sets, every term of the objective."""
    import random

    rng = random.Random(11)
    n = matrix.size
    saved = placement_module.SMALL_TABLE_SETS
    try:
        for k, pattern, nics in shapes:
            for _ in range(25):
                busy = rng.sample(range(n), rng.randint(0, n - k))
                req = Request(gpus=k, pattern=pattern, nics=nics, single_numa=rng.random() < 0.2)
                # Half the time live signals: interchangeable GPUs then differ in term (6).
                live = Live(
                    frozenset(rng.sample(range(n), rng.randint(0, 3))),
                    {nic.device or nic.name: rng.choice([0.0, 5e9, 30e9]) for nic in matrix.nics},
                ) if rng.random() < 0.5 else Live()
                placement_module.SMALL_TABLE_SETS = 10**6
                exhaustive = place(matrix, req, busy, live=live)
                placement_module.SMALL_TABLE_SETS = 0
                searched = place(matrix, req, busy, live=live)
                assert type(searched) is type(exhaustive), (req, busy)
                if isinstance(exhaustive, Placement):
                    assert (searched.bandwidth_gbps, searched.objective) == (
                        exhaustive.bandwidth_gbps,
                        exhaustive.objective,
                    ), (req, busy, searched.indices, exhaustive.indices)
    finally:
        placement_module.SMALL_TABLE_SETS = saved


# --- NUMA distance on the recorded nodes (SLIT tables) ---------------------------------


def snapshot_matrices() -> list[tuple[str, DistanceMatrix]]:
    from topoagent.commands.discover import discover_root

    root = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"
    out = []
    for path in sorted(root.iterdir()):
        if path.name in WITHOUT_GPU_STACK:  # links no witness saw: not ready for placement (tests/test_witnesses.py)
            continue
        matrix = discover_root(str(path)).distance_matrix()
        if 2 <= matrix.size <= 8:  # brute force over orders: 16 GPUs is too slow for a test
            out.append((path.name, matrix))
    return out


SNAPSHOT_MATRICES = snapshot_matrices()


def test_snapshots_carry_their_numa_distances():
    by_name = dict(SNAPSHOT_MATRICES)
    a100 = by_name["dgx-a100"]
    assert a100.numa_distance(3, 7) == 32 and a100.numa_distance(7, 5) == 12 and a100.numa_distance(3, 3) == 10


@pytest.mark.parametrize("name,matrix", SNAPSHOT_MATRICES, ids=[n for n, _ in SNAPSHOT_MATRICES])
def test_snapshots_match_brute_force_with_numa_distances(name, matrix, search_path):
    """Every recorded node, with its SLIT table and its NICs' health: random busy sets,
    every k, against brute force (the new order: bandwidth, NUMA distance, nodes...)."""
    import random

    rng = random.Random(name)
    indices = [g.index for g in matrix.gpus]
    cache: dict = {}
    for round_no in range(6):
        busy = rng.sample(indices, rng.randint(0, len(indices) - 1))
        # Odd rounds with live signals: a GPU given back unverified, NICs carrying traffic.
        live = Live(
            frozenset(rng.sample(indices, 1)), {nic.device or nic.name: rng.choice([0.0, 4e9, 12e9]) for nic in matrix.nics}
        ) if round_no % 2 else None
        for k in range(1, len(indices) - len(busy) + 1):
            for req in (Request(gpus=k), Request(gpus=k, pattern="alltoall"), Request(gpus=k, nics=min(2, len(matrix.nics)))):
                check_answer(matrix, req, busy, place(matrix, req, busy, live=live or Live()), cache, live)


# --- the graph facts the ring search relies on ------------------------------------------


@st.composite
def small_graph(draw):
    """A random graph on up to 9 GPUs (adjacency bitmasks) and a subset of its GPUs."""
    n = draw(st.integers(1, 9))
    density = draw(st.sampled_from([0.15, 0.3, 0.5, 0.8]))
    adjacency = [0] * n
    for i in range(n):
        for j in range(i + 1, n):
            if draw(st.floats(0, 1)) < density:
                adjacency[i] |= 1 << j
                adjacency[j] |= 1 << i
    verts = draw(st.integers(0, (1 << n) - 1))
    return adjacency, verts


def _vertices(mask: int) -> list[int]:
    return [v for v in range(mask.bit_length()) if mask >> v & 1]


def _biconnected(mask: int, adjacency: list[int]) -> bool:
    """Brute force: one edge, or connected with no GPU whose removal disconnects it."""
    vs = _vertices(mask)
    if len(vs) == 2:
        return bool(adjacency[vs[0]] >> vs[1] & 1)
    connected = tables_module.connected_components
    return len(connected(mask, adjacency)) == 1 and all(
        len(connected(mask & ~(1 << v), adjacency)) == 1 for v in vs
    )


@settings(max_examples=300, deadline=None)
@given(small_graph())
def test_biconnected_blocks_are_the_maximal_biconnected_sets(graph):
    """A ring lies inside one block: the search skips candidates outside every block of k
    or more, so the blocks must be exactly the maximal biconnected vertex sets."""
    adjacency, verts = graph
    expected: list[int] = []
    for size in range(verts.bit_count(), 1, -1):
        for combo in combinations(_vertices(verts), size):
            mask = sum(1 << v for v in combo)
            if not any(mask & ~bigger == 0 for bigger in expected) and _biconnected(mask, adjacency):
                expected.append(mask)
    assert sorted(rings_module.biconnected_blocks(verts, adjacency)) == sorted(expected)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-8, 16), st.integers(1, 8)), max_size=3),
    st.integers(1, 12),
)
def test_least_concave_fill_is_the_least_damage_of_any_split(parts, rem):
    """The damage bound's exact case: the least of sum a_i * (rate_i + c_i - a_i) over every
    way of taking rem of the zones' c_i candidates (0 when they cannot hold rem)."""
    from itertools import product

    splits = [a for a in product(*(range(c + 1) for _, c in parts)) if sum(a) == rem]
    least = min((sum(x * (r + c - x) for x, (r, c) in zip(a, parts)) for a in splits), default=0)
    assert bounds_module.least_concave_fill(parts, rem) == least


def _rings_brute_force(mask: int, adjacency: list[int]) -> list[tuple[int, ...]]:
    """Every ring through all of ``mask`` (each once per direction, from its lowest GPU)."""
    from itertools import permutations

    vs = _vertices(mask)
    if len(vs) < 3:
        return []
    first, rest = vs[0], vs[1:]
    return [
        (first, *order)
        for order in permutations(rest)
        if all(adjacency[a] >> b & 1 for a, b in zip((first, *order), (*order, first)))
    ]


@settings(max_examples=300, deadline=None)
@given(small_graph())
def test_ring_links_keep_every_link_a_ring_uses(graph):
    """rings.ring_links drops only links no ring through the whole set uses, and says None
    only where brute force finds no ring at all."""
    adjacency, verts = graph
    found = _rings_brute_force(verts, adjacency)
    links = rings_module.ring_links(verts, adjacency)
    if links is None:
        assert not found
        return
    for ring in found:
        for a, b in zip(ring, ring[1:] + ring[:1]):
            assert links[a] >> b & 1 and links[b] >> a & 1, (ring, a, b)


def test_ring_may_hold_rules_out_only_what_has_no_ring():
    """rings.ring_may_hold (the forcing a ring check carries on) says False only where brute
    force finds no ring of k GPUs inside ``reach`` through all of ``taken`` -- and it does
    say so where every member taken has two links or more there, which is all the plain
    degree check sees."""
    import random

    rng = random.Random(38)
    ruled_out = 0
    for _ in range(600):
        n = rng.randint(4, 9)
        density = rng.choice((0.3, 0.45, 0.6))
        adjacency = [0] * n
        for i in range(n):
            for j in range(i + 1, n):
                if rng.random() < density:
                    adjacency[i] |= 1 << j
                    adjacency[j] |= 1 << i
        reach = rng.randrange(1, 1 << n)
        vs = _vertices(reach)
        if len(vs) < 3:
            continue
        k = rng.randint(3, len(vs))
        taken = sum(1 << v for v in rng.sample(vs, rng.randint(1, k)))
        if any((adjacency[v] & reach).bit_count() < 2 for v in _vertices(taken)):
            continue  # the plain check rules it out already
        tight = sum(1 << v for v in _vertices(taken) if (adjacency[v] & reach).bit_count() == 2)
        others = _vertices(reach & ~taken)
        ring = any(
            _rings_brute_force(taken | sum(1 << v for v in extra), adjacency)
            for extra in combinations(others, k - taken.bit_count())
        )
        if not rings_module.ring_may_hold(taken, reach, adjacency, k, tight):
            assert not ring, (adjacency, reach, taken, k)
            ruled_out += 1
    assert ruled_out >= 20, ruled_out


def _first_order_by_backtracking(ring_memo, mask: int, adjacency: list[int], cycle: bool):
    """The order plain backtracking finds first, trying GPUs in the ring search's order
    (its starts; fewest onward options first, best link first) and cutting nothing."""
    rank, verts = ring_memo.rank, sorted(_vertices(mask), key=ring_memo.hier_pos.__getitem__)
    k = len(verts)
    if k == 1 or all(adjacency[v] & mask == mask & ~(1 << v) for v in verts):
        return tuple(verts)
    degree = {v: (adjacency[v] & mask).bit_count() for v in verts}
    starts = verts[:1] if cycle else sorted(verts, key=degree.__getitem__)
    if not cycle and degree[starts[0]] == 1:
        starts = starts[:1]

    def extend(path: list[int], left: int):
        if not left:
            return tuple(path) if k > 2 and (not cycle or adjacency[path[-1]] >> path[0] & 1) else None
        last = path[-1]
        options = sorted(_vertices(adjacency[last] & left), key=lambda v: ((adjacency[v] & left).bit_count(), -rank[last][v]))
        for v in options:
            got = extend([*path, v], left & ~(1 << v))
            if got is not None:
                return got
        return None

    for start in starts:
        got = extend([start], mask & ~(1 << start))
        if got is not None:
            return got
    return None


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 9), st.integers(0, 10**6), st.sampled_from([0.3, 0.5, 0.7]))
def test_ring_search_finds_the_order_plain_backtracking_finds_first(n, seed, p):
    """What the ring and path search cuts (links no ring uses, sets a GPU's removal splits,
    the states it failed from before) holds no ring or path: on every subset of a small
    irregular mesh, at every threshold, it answers with the very order backtracking that
    cuts nothing finds first, or None where that finds none."""
    from topoagent.placement.synthetic import irregular_mesh

    matrix = irregular_mesh(n, seed=seed, p=p, socket_size=4)
    prep = tables_module.prepare(matrix, None)
    ring_memo = rings_module.Rings(prep)
    for r in range(prep.n_ranks):
        adjacency = ring_memo.adj(r)
        for mask in range(1, 1 << n):
            for cycle in (True, False):
                expected = _first_order_by_backtracking(ring_memo, mask, adjacency, cycle)
                assert ring_memo._ham_search(mask, adjacency, cycle, None) == expected, (r, bin(mask), cycle)
