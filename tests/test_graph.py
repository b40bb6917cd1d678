"""The concept graph: consolidation (`memory.build.graph`), the walk and the graph leg
(`memory.recall.graph`), the `memory_related` tool and the admin API, against a real Postgres.

Conversations are built with the real tree builder (extractive summaries, `final=True`: one
segment each) and an embedder whose vectors are planned: a concept's name gets a vector at a
chosen cosine similarity from another's, so merging is tested on both sides of the threshold;
every other text gets a deterministic vector of its own.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.upstream_script import embedding_vector
from gateway.settings import Settings
from memory.build import graph as build_graph
from memory.build import tree
from memory.build.summarize import ExtractiveSummarizer
from memory.concepts import SCHEMATIC, scope_key
from memory.embeddings import LocalEmbedder
from memory.errors import NotFound
from memory.recall import graph, retrieval, tools
from memory.recall.assemble import BudgetRules, Recall, dry_run
from memory.recall.fusion import Candidates
from memory.recall.query import Route, route
from memory.recall.working_context import Policy
from tests.inprocess import App, running_app
from tests.stored import MODEL, built_conversation

THRESHOLD = 0.85


def _at(similarity: float, base: Sequence[float], other: Sequence[float]) -> list[float]:
    """A unit vector at cosine `similarity` from the unit vector `base`, in the plane of `other`."""
    dot = sum(a * b for a, b in zip(base, other, strict=True))
    ortho = [o - dot * b for o, b in zip(other, base, strict=True)]
    norm = math.sqrt(sum(x * x for x in ortho))
    ortho = [x / norm for x in ortho]
    sine = math.sqrt(1 - similarity**2)
    return [similarity * b + sine * o for b, o in zip(base, ortho, strict=True)]


class PlannedEmbedder:
    """Planned vectors for some texts, a deterministic vector of its own for any other."""

    name = "planned"
    dim = 384

    def __init__(self, planned: Mapping[str, list[float]] | None = None) -> None:
        self.planned = dict(planned or {})

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.planned.get(t) or embedding_vector(t, self.dim) for t in texts]


ALPHA = embedding_vector("alpha concept", 384)
PLANNED = {
    "alpha concept": ALPHA,
    "alpha notion": _at(THRESHOLD + 0.002, ALPHA, embedding_vector("x", 384)),
    "alpha theory": _at(THRESHOLD - 0.002, ALPHA, embedding_vector("y", 384)),
}


def config(embedder: PlannedEmbedder | None = None) -> tree.TreeConfig:
    embed = embedder or PlannedEmbedder(PLANNED)
    return tree.TreeConfig(
        embedder=embed,
        summarizer=ExtractiveSummarizer(MODEL),
        graph=build_graph.GraphConfig(embedder=embed, merge_similarity=THRESHOLD),
    )


async def conversation(
    engine: AsyncEngine,
    tenant_id: int,
    texts: Sequence[str],
    *,
    user: str | None = None,
    built: tree.TreeConfig | None = None,
) -> tuple[int, str, list[int]]:
    """A conversation of `texts`, built (one segment, or a few) with the graph."""
    return await built_conversation(engine, tenant_id, texts, config=built or config(), user=user)


async def concepts_of(engine: AsyncEngine, tenant_id: int) -> dict[str, tuple[str, int]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT key, scope, frequency FROM concepts WHERE tenant_id = :t"),
            {"t": tenant_id},
        )
        return {str(key): (str(scope), int(freq)) for key, scope, freq in rows}


# -- consolidation --------------------------------------------------------------------------


def test_concept_keys_and_scope() -> None:
    assert scope_key(user="ann", conversation_id=3) == "user:ann"
    assert scope_key(user=None, conversation_id=3) == "conversation:3"
    assert route("How does the alpha concept relate to the budget?") is Route.RELATIONAL
    assert route("Explain the outage") is Route.RELATIONAL
    assert route("What caused the outage") is Route.RELATIONAL
    assert route("x" * 81) is Route.RELATIONAL
    assert route("What is the code?") is Route.FLAT


async def test_a_concept_within_the_threshold_merges_and_one_below_does_not(
    engine: AsyncEngine, tenant_id: int
) -> None:
    await conversation(
        engine, tenant_id, ["we talked about the alpha concept", "yes, the alpha concept"], user="u"
    )
    await conversation(
        engine, tenant_id, ["now the alpha notion", "right, the alpha notion again"], user="u"
    )
    await conversation(
        engine, tenant_id, ["then the alpha theory", "indeed, the alpha theory"], user="u"
    )
    found = await concepts_of(engine, tenant_id)
    # 0.852 from "alpha concept": merged into it (its frequency counts both segments).
    assert "alpha notion" not in found
    assert found["alpha concept"] == ("user:u", 2)
    # 0.848: a concept of its own.
    assert found["alpha theory"] == ("user:u", 1)


async def test_concepts_merge_only_within_their_scope(engine: AsyncEngine, tenant_id: int) -> None:
    await conversation(engine, tenant_id, ["the alpha concept", "the alpha concept"], user="u")
    await conversation(engine, tenant_id, ["the alpha notion", "the alpha notion"], user="v")
    other, _, _ = await conversation(engine, tenant_id, ["the alpha notion", "the alpha notion"])
    found = await concepts_of(engine, tenant_id)
    assert found["alpha concept"] == ("user:u", 1)
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT scope FROM concepts WHERE tenant_id = :t AND key = 'alpha notion'"),
            {"t": tenant_id},
        )
        assert sorted(rows.scalars()) == [f"conversation:{other}", "user:v"]


async def test_schematic_at_five_segments(engine: AsyncEngine, tenant_id: int) -> None:
    for count in range(1, SCHEMATIC + 1):
        conversation_id, _, _ = await conversation(
            engine,
            tenant_id,
            ["the quarterly roadmap review", "the quarterly roadmap review again"],
            user="u",
        )
        async with engine.connect() as conn:
            found = await graph.find_concepts(
                conn, tenant_id=tenant_id, query="quarterly roadmap", limit=5
            )
            drawn = await graph.conversation_graph(
                conn, tenant_id=tenant_id, conversation_id=conversation_id, limit=50
            )
        [concept] = found
        assert concept.frequency == count
        assert concept.schematic is (count >= SCHEMATIC)
        assert drawn.version == count  # one consolidation per closed segment
        assert concept.id in {c.id for c in drawn.concepts}


async def test_edges_and_mentions_of_a_segment(engine: AsyncEngine, tenant_id: int) -> None:
    conversation_id, _, node_ids = await conversation(
        engine,
        tenant_id,
        [
            "the garden irrigation plan needs the rain barrel",
            "the rain barrel feeds the garden irrigation plan",
        ],
    )
    async with engine.connect() as conn:
        drawn = await graph.conversation_graph(
            conn, tenant_id=tenant_id, conversation_id=conversation_id, limit=50
        )
        mentioned = {
            int(node)
            for node in await conn.scalars(
                text("SELECT node_id FROM concept_mentions WHERE tenant_id = :t"),
                {"t": tenant_id},
            )
        }
    names = {c.id: c.name for c in drawn.concepts}
    assert {"garden irrigation plan", "rain barrel"} <= set(names.values())
    pairs = {(names[e.source], names[e.target], e.kind) for e in drawn.edges}
    assert any({a, b} == {"garden irrigation plan", "rain barrel"} for a, b, _ in pairs)
    # Both messages and the segment's summary mention them.
    assert set(node_ids) <= mentioned and len(mentioned) == 3


# -- the walk -----------------------------------------------------------------------------------


async def _concepts(engine: AsyncEngine, tenant_id: int, names: Sequence[str]) -> dict[str, int]:
    async with engine.begin() as conn:
        rows = await conn.execute(
            text(
                "INSERT INTO concepts (tenant_id, scope, key, name) "
                "SELECT :t, 'user:walk', n, n FROM unnest(CAST(:names AS text[])) AS n "
                "RETURNING key, id"
            ),
            {"t": tenant_id, "names": list(names)},
        )
        return {str(key): int(concept) for key, concept in rows}


async def _edges(
    engine: AsyncEngine, tenant_id: int, edges: Sequence[tuple[int, int, int]]
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO concept_edges (source_id, target_id, kind, tenant_id, weight) "
                "SELECT s, t, 'co_occurs', :tenant, w FROM unnest(CAST(:s AS bigint[]), "
                "CAST(:t AS bigint[]), CAST(:w AS integer[])) AS u(s, t, w)"
            ),
            {
                "tenant": tenant_id,
                "s": [e[0] for e in edges],
                "t": [e[1] for e in edges],
                "w": [e[2] for e in edges],
            },
        )


async def test_the_walk_stops_at_depth_two_and_never_loops(
    engine: AsyncEngine, tenant_id: int
) -> None:
    ids = await _concepts(engine, tenant_id, ["a", "b", "c", "d", "e"])
    a, b, c, d, e = (ids[n] for n in "abcde")
    # a - b - c - d in a chain, and a cycle a - b - e - a.
    await _edges(engine, tenant_id, [(a, b, 1), (b, c, 1), (c, d, 1), (b, e, 1), (a, e, 1)])
    async with engine.connect() as conn:
        reached = await graph.walk(conn, tenant_id=tenant_id, start={a: 1.0})
    assert reached[a][0] == 0
    assert reached[b][0] == 1 and reached[e][0] == 1
    assert reached[c][0] == 2
    assert d not in reached  # three steps away
    assert reached[b][1] > reached[c][1]  # a step further weighs less


async def test_the_walk_follows_the_heaviest_edges_only(
    engine: AsyncEngine, tenant_id: int
) -> None:
    names = ["hub", *(f"spoke {i}" for i in range(graph.FANOUT + 4))]
    ids = await _concepts(engine, tenant_id, names)
    hub = ids["hub"]
    spokes = [ids[f"spoke {i}"] for i in range(graph.FANOUT + 4)]
    await _edges(engine, tenant_id, [(hub, s, weight) for weight, s in enumerate(spokes, 1)])
    async with engine.connect() as conn:
        reached = await graph.walk(conn, tenant_id=tenant_id, start={hub: 1.0}, depth=1)
    assert set(reached) == {hub, *spokes[-graph.FANOUT :]}


async def test_another_tenants_concepts_are_never_walked(
    engine: AsyncEngine, tenant_id: int
) -> None:
    ids = await _concepts(engine, tenant_id, ["mine", "neighbour"])
    await _edges(engine, tenant_id, [(ids["mine"], ids["neighbour"], 3)])
    async with engine.begin() as conn:
        other = await conn.scalar(
            text("INSERT INTO tenants (name) VALUES (:n) RETURNING id"),
            {"n": f"test-{uuid.uuid4().hex}"},
        )
    async with engine.connect() as conn:
        assert await graph.walk(conn, tenant_id=int(other), start={ids["mine"]: 1.0}) == {}


# -- the graph leg and its route ------------------------------------------------------------------

GARDEN = [
    "I planted tomatoes in the raised bed next to the rain barrel.",
    "The rain barrel waters the raised bed through a drip line.",
    "Tomatoes in the raised bed need calcium, or they get blossom end rot.",
    "Crushed eggshells add calcium to the raised bed soil.",
    "Unrelated: the car needs new winter tyres before December.",
]


QUESTION = "How does the rain barrel relate to blossom end rot?"


async def leg_of(
    engine: AsyncEngine, tenant_id: int, conversation_id: int, question: str
) -> tuple[list[Candidates], Route]:
    [vector] = await PlannedEmbedder().embed([question])
    async with engine.connect() as conn:
        return await graph.leg(
            conn,
            tenant_id=tenant_id,
            conversation_ids=[conversation_id],
            query=question,
            query_vector=vector,
            which=route(question),
            limit=20,
        )


async def test_a_relational_question_takes_the_graph_route(
    engine: AsyncEngine, tenant_id: int
) -> None:
    conversation_id, _, _ = await conversation(engine, tenant_id, GARDEN)
    legs, taken = await leg_of(engine, tenant_id, conversation_id, QUESTION)
    assert taken is Route.GRAPH
    [leg] = legs
    keys = [place.key for place in leg.ranked if place.key[1] == 0]
    # The messages of the concepts it names first; those of their neighbours after (one
    # segment: every concept of it co-occurs with every other).
    assert set(keys[:2]) == {(conversation_id, 0, 0), (conversation_id, 0, 2)}
    assert keys[-1] == (conversation_id, 0, 4)


async def test_an_empty_graph_falls_back_to_flat(engine: AsyncEngine, tenant_id: int) -> None:
    plain = tree.TreeConfig(embedder=PlannedEmbedder(), summarizer=ExtractiveSummarizer(MODEL))
    conversation_id, _, node_ids = await conversation(engine, tenant_id, GARDEN, built=plain)
    legs, taken = await leg_of(engine, tenant_id, conversation_id, QUESTION)
    [vector] = await PlannedEmbedder().embed([QUESTION])
    async with engine.connect() as conn:
        hits = await retrieval.search(
            conn,
            tenant_id=tenant_id,
            conversation_ids=[conversation_id],
            query=QUESTION,
            query_vector=vector,
        )
    assert (legs, taken) == ([], Route.RELATIONAL)
    assert node_ids[0] in {hit.node_id for hit in hits}  # flat retrieval still finds it


async def test_the_note_and_the_rebuild_take_the_graph_leg_only_when_asked(
    engine: AsyncEngine, tenant_id: int
) -> None:
    # Longer than the budget: the prompt is the working context with a recall note, or rebuilt.
    # MiniLM's vectors: a note quotes only messages that bear on the question.
    embedder = LocalEmbedder()
    built = tree.TreeConfig(
        embedder=embedder,
        summarizer=ExtractiveSummarizer(MODEL),
        graph=build_graph.GraphConfig(embedder=embedder, merge_similarity=THRESHOLD),
    )
    _, external_id, _ = await conversation(engine, tenant_id, GARDEN * 12, built=built)
    routes = {}
    for mode in ("working", "rebuild"):
        for use_graph in (False, True):
            assembled = await dry_run(
                engine,
                tenant_id=tenant_id,
                external_id=external_id,
                query=QUESTION,
                budget=1000,
                rules=BudgetRules(default=1000, window=32768, output_reserve=0),
                tools_room=0,
                recall=Recall(
                    embedder=embedder, policy=Policy(note=0.6), mode=mode, graph=use_graph
                ),
            )
            routes[mode, use_graph] = assembled.route
            if use_graph:
                assert any(leg.leg == "graph" for why in assembled.why for leg in why.legs)
    assert routes == {
        ("working", False): "relational",
        ("working", True): "graph",
        ("rebuild", False): "relational",
        ("rebuild", True): "graph",
    }


async def test_a_conversation_summarized_without_the_graph_is_backfilled_once(
    engine: AsyncEngine, tenant_id: int
) -> None:
    plain = tree.TreeConfig(embedder=PlannedEmbedder(), summarizer=ExtractiveSummarizer(MODEL))
    conversation_id, _, _ = await conversation(engine, tenant_id, GARDEN, built=plain)
    assert (await leg_of(engine, tenant_id, conversation_id, QUESTION))[1] is Route.RELATIONAL
    graphed = config().graph
    assert graphed is not None
    done = [
        await build_graph.backfill(
            engine, graphed, tenant_id=tenant_id, conversation_id=conversation_id
        )
        for _ in range(2)
    ]
    assert done[0] > 0 and done[1] == 0  # its segments, then nothing: they are in the graph
    assert (await leg_of(engine, tenant_id, conversation_id, QUESTION))[1] is Route.GRAPH


# -- memory_related and isolation ------------------------------------------------------------


async def test_memory_related_gives_neighbours_and_their_messages(
    engine: AsyncEngine, tenant_id: int
) -> None:
    conversation_id, _, node_ids = await conversation(engine, tenant_id, GARDEN)
    scope = tools.Scope(tenant_id=tenant_id, conversation_id=conversation_id)
    async with engine.connect() as conn:
        result = await tools.call(
            conn,
            scope,
            name="memory_related",
            arguments={"concept": "Rain Barrel"},
            embedder=PlannedEmbedder(),
        )
    assert result.startswith("concept 'rain barrel'")
    assert "raised bed" in result
    assert f"[#{node_ids[1]}]" in result


async def test_another_tenants_concept_behaves_as_missing(
    engine: AsyncEngine, tenant_id: int
) -> None:
    conversation_id, _, _ = await conversation(engine, tenant_id, GARDEN)
    async with engine.begin() as conn:
        other = int(
            await conn.scalar(
                text("INSERT INTO tenants (name) VALUES (:n) RETURNING id"),
                {"n": f"test-{uuid.uuid4().hex}"},
            )
        )
    theirs, _, _ = await conversation(engine, other, ["nothing about gardens", "nor here"])
    async with engine.connect() as conn:
        # Another tenant asking by its own conversation, or naming ours, finds nothing.
        for scope in (
            tools.Scope(tenant_id=other, conversation_id=theirs),
            tools.Scope(tenant_id=other, conversation_id=conversation_id),
        ):
            with pytest.raises(NotFound):
                await tools.call(
                    conn,
                    scope,
                    name="memory_related",
                    arguments={"concept": "rain barrel"},
                    embedder=PlannedEmbedder(),
                )
        assert await graph.find_concepts(conn, tenant_id=other, query="rain", limit=5) == []
        legs, taken = await graph.leg(
            conn,
            tenant_id=other,
            conversation_ids=[conversation_id],
            query="how does the rain barrel relate to the raised bed?",
            query_vector=None,
            which=Route.RELATIONAL,
            limit=10,
        )
        assert (legs, taken) == ([], Route.RELATIONAL)


# -- the admin API --------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def app(database_url: str) -> AsyncIterator[App]:
    # Rebuilt per query: every dry run retrieves, so it shows its route (the working context's
    # note is tested with MiniLM above).
    settings = Settings(
        _env_file=None,
        database_url=database_url,
        workers=0,
        graph_recall="on",
        context_mode="rebuild",
    )
    async with running_app(settings) as up:
        yield up


@pytest.fixture
async def admin(app: App) -> AsyncIterator[httpx.AsyncClient]:
    async with app.client() as client:
        yield client


async def _tenant(admin: httpx.AsyncClient) -> tuple[str, int]:
    name = f"graph-{uuid.uuid4().hex[:10]}"
    created = await admin.post("/admin/tenants", json={"name": name})
    assert created.status_code == 201, created.text
    return name, int(created.json()["id"])


async def test_the_dry_run_shows_the_graph_route_and_its_fallback(
    admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    name, tenant_id = await _tenant(admin)
    plain = tree.TreeConfig(embedder=PlannedEmbedder(), summarizer=ExtractiveSummarizer(MODEL))
    # Longer than the budget below leaves once the memory tools' definitions are reserved.
    history = GARDEN * 6
    _, with_graph, _ = await conversation(engine, tenant_id, history)
    _, without, _ = await conversation(engine, tenant_id, history, built=plain)
    routes = {}
    for external_id in (with_graph, without):
        dry = await admin.post(
            f"/admin/conversations/{external_id}/context",
            params={"tenant": name},
            json={"query": QUESTION, "budget": 500},
        )
        assert dry.status_code == 200, dry.text
        routes[external_id] = dry.json()["route"]
    assert routes == {with_graph: "graph", without: "relational"}


async def test_admin_graph_and_concepts_are_tenant_scoped(
    admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    mine, mine_id = await _tenant(admin)
    theirs, _ = await _tenant(admin)
    _, external_id, _ = await conversation(engine, mine_id, GARDEN)
    drawn = await admin.get(f"/admin/conversations/{external_id}/graph", params={"tenant": mine})
    assert drawn.status_code == 200, drawn.text
    body = drawn.json()
    stats = await admin.get(f"/admin/conversations/{external_id}", params={"tenant": mine})
    segments = stats.json()["levels"]["1"]
    # One consolidation per closed segment.
    assert body["version"] == segments and body["scope"].startswith("conversation:")
    names = {c["name"] for c in body["concepts"]}
    assert "rain barrel" in names and all(c["schematic"] is False for c in body["concepts"])
    assert body["edges"] and {e["kind"] for e in body["edges"]} <= {"co_occurs", "precedes"}
    found = await admin.get("/admin/concepts", params={"tenant": mine, "q": "Rain"})
    named = [c["name"] for c in found.json()["data"]]
    assert "rain barrel" in named and all("rain" in name for name in named)
    assert (await admin.get("/admin/concepts", params={"tenant": theirs, "q": "rain"})).json()[
        "data"
    ] == []
    hidden = await admin.get(f"/admin/conversations/{external_id}/graph", params={"tenant": theirs})
    assert hidden.status_code == 404
    assert stats.json()["tiers"] == {"hot": 0, "warm": 0, "cold": len(GARDEN) + segments}
    # Deleting the conversation deletes its own graph.
    gone = await admin.delete(f"/admin/conversations/{external_id}", params={"tenant": mine})
    assert gone.status_code == 200
    left = await admin.get("/admin/concepts", params={"tenant": mine, "q": "rain"})
    assert left.json()["data"] == []
