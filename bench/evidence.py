"""Evidence recall: what `bench.locomo` and `bench.longmemeval` share.

A benchmark of this kind replays a dataset's conversation through the real import path, asks a
question as the conversation's next user message through the gateway's dry run, and scores the
prompt by the share of the question's evidence turns present in it verbatim. The same budgets
and token counting go to three baselines. This module holds every part the datasets share:

* `Turn` and `Replayed` -- a conversation's turns as stored, and what its replay yields (the
  conversation's id, its messages' MiniLM vectors);
* `database()` -- a throw-away embedded Postgres (or one kept in a folder), migrated, with the
  benchmark's tenant; `states()` -- the gateway's `State`s a question is asked through: the
  memory tools off, the same rebuilding each prompt for its query (`MEMSTRATA_CONTEXT_MODE=
  rebuild`), the same with the concept graph's leg (`MEMSTRATA_GRAPH_RECALL=on`: the method
  `memstrata_graph`), and the tools offered; `context_settings()` -- the working context's
  settings a run measured (the environment's `MEMSTRATA_*` apply);
* `replay()` -- the turns through `gateway.importer.import_messages`, then the summary tree
  (extractive summaries, local MiniLM; `memory.build.tree.build`, `final=True`) with the
  concept graph (unless `MEMSTRATA_GRAPH=off`);
* the baselines -- `newest()` (the newest turns as chat messages), `embedding_ranked()` and
  `fulltext_ranked()` (flat MiniLM cosine, Postgres `ts_rank_cd`), laid out by `fill_lines()`
  as one memory message of `[date speaker] text` lines;
* `Scores` -- every method's prompt for one question and budget (`Scores.measure`), scored by
  `present()`, and the tables of means per group (a LoCoMo category, a LongMemEval type).

The markdown tables and the docs' sections are `bench.evidence_report`'s.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import numpy as np
from sqlalchemy import insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.postgres import throwaway_postgres
from devkit.stats import percentile
from gateway import background, importer
from gateway.openai import chat
from gateway.settings import Settings
from gateway.state import State
from memory import tokens
from memory.build import graph, tree
from memory.build.summarize import ExtractiveSummarizer
from memory.db import connect, migrate
from memory.embeddings import LocalEmbedder
from memory.recall import retrieval, tools
from memory.recall.assemble import Assembled
from memory.schema import nodes, tenants

MODEL = "gpt-4o"
METHODS = (
    "memstrata",
    "memstrata_rebuild",
    "memstrata_graph",
    "memstrata_tools",
    "newest",
    "flat_embedding",
    "flat_fulltext",
)


@dataclass
class Turn:
    """One dataset turn, stored as one message."""

    key: str
    seq: int
    speaker: str
    role: str
    text: str
    created_at: datetime
    name: str | None = None

    def message(self) -> dict[str, Any]:
        """The OpenAI message the turn is stored as (and a client would send)."""
        found: dict[str, Any] = {"role": self.role}
        if self.name is not None:
            found["name"] = self.name
        found["content"] = self.text
        return found


@dataclass(kw_only=True)
class Replayed:
    """A conversation to replay, and what its replay yields."""

    external_id: str
    turns: list[Turn]
    conversation_id: int = 0
    embeddings: Any = None
    embedded: list[int] = field(default_factory=list)
    """The seq of each row of `embeddings` (a message without text has no vector)."""


@contextlib.asynccontextmanager
async def database(
    *, prefix: str, tenant: str, folder: Path | None = None, url: str | None = None
) -> AsyncIterator[tuple[AsyncEngine, int]]:
    """A migrated database and the id of the tenant named `tenant` (created if missing): the
    running Postgres at `url`, else an embedded one, throw-away unless `folder` keeps it."""
    async with contextlib.AsyncExitStack() as stack:
        if url is None:
            # Nothing else runs on the event loop: starting and stopping the server may block it.
            url = stack.enter_context(throwaway_postgres(prefix=prefix, folder=folder)).url
        engine = connect(url)
        stack.push_async_callback(engine.dispose)
        await migrate(engine)
        async with engine.begin() as conn:
            found = await conn.scalar(select(tenants.c.id).where(tenants.c.name == tenant))
            if found is None:
                found = await conn.scalar(
                    insert(tenants).values(name=tenant).returning(tenants.c.id)
                )
        yield engine, int(found)


@dataclass(frozen=True)
class States:
    """The gateway's states a question is asked through: the memory tools off (`plain`), the
    same with each prompt rebuilt for its query (`rebuild`, `MEMSTRATA_CONTEXT_MODE=rebuild`),
    the same as `plain` with the concept graph's leg (`graph`, `MEMSTRATA_GRAPH_RECALL=on`),
    and the tools offered (`offered`, the default). Other settings come from the environment."""

    plain: State
    rebuild: State
    graph: State
    offered: State


def context_settings(states: States) -> dict[str, Any]:
    """The settings the `memstrata` method's prompts depend on, to record beside its figures."""
    settings = states.plain.settings
    return {
        "context_mode": settings.context_mode,
        "context_high_water": settings.context_high_water,
        "context_low_water": settings.context_low_water,
        "note_share": settings.note_share,
        "keep_notes": settings.keep_notes,
    }


def states(engine: AsyncEngine, embedder: LocalEmbedder, tenant: int) -> States:
    """The states `Scores` asks through (see `States`)."""

    def state(**overrides: Any) -> State:
        return State(
            settings=Settings(_env_file=None, **overrides),
            engine=engine,
            upstream=cast(Any, None),
            embedder=embedder,
            default_tenant_id=tenant,
        )

    return States(
        plain=state(memory_tools="never"),
        rebuild=state(memory_tools="never", context_mode="rebuild"),
        graph=state(memory_tools="never", graph_recall="on"),
        offered=state(memory_tools="auto"),
    )


async def replay(
    engine: AsyncEngine, tenant: int, replayed: Replayed, embedder: LocalEmbedder
) -> None:
    """Import the turns (what is stored already is skipped), build the summary tree, and load
    the messages' vectors into `replayed`."""
    await importer.import_messages(
        engine,
        tenant_id=tenant,
        external_id=replayed.external_id,
        messages=[turn.message() for turn in replayed.turns],
        created_at=[turn.created_at for turn in replayed.turns],
        model=MODEL,
        batch=1000,
    )
    async with engine.connect() as conn:
        replayed.conversation_id = int(
            await conn.scalar(
                text("SELECT id FROM conversations WHERE tenant_id = :t AND external_id = :e"),
                {"t": tenant, "e": replayed.external_id},
            )
        )
    # MEMSTRATA_GRAPH=off builds no concept graph: the graph leg then has nothing to walk.
    config = tree.TreeConfig(
        embedder=embedder,
        summarizer=ExtractiveSummarizer(),
        graph=background.graph_config(Settings(_env_file=None), embedder),
    )
    await tree.build(
        engine,
        tenant_id=tenant,
        conversation_id=replayed.conversation_id,
        config=config,
        final=True,
    )
    if config.graph is not None:  # a database kept from before the graph (migration 0012)
        await graph.backfill(
            engine, config.graph, tenant_id=tenant, conversation_id=replayed.conversation_id
        )
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(nodes.c.seq, nodes.c.embedding)
                .where(
                    nodes.c.conversation_id == replayed.conversation_id,
                    nodes.c.level == 0,
                    nodes.c.embedding.is_not(None),
                )
                .order_by(nodes.c.seq)
            )
        ).all()
        replayed.embedded = [row.seq for row in rows]
        replayed.embeddings = np.asarray([list(row.embedding) for row in rows], dtype=np.float32)


# -- baselines -------------------------------------------------------------------------------


def _line(turn: Turn) -> str:
    return f"[{turn.created_at:%Y-%m-%d %H:%M} {turn.speaker}] {turn.text}"


def fill_lines(turns: Sequence[Turn], question: str, budget: int) -> list[dict[str, Any]]:
    """One memory message of `[date speaker] text` lines, in rank order, within `budget`."""
    ask = {"role": "user", "content": question}
    chosen: list[Turn] = []
    used = tokens.count_messages([{"role": "system", "content": ""}, ask], model=MODEL)
    for turn in turns:
        cost = tokens.count_text(_line(turn), model=MODEL) + 1
        if used + cost > budget:
            continue
        chosen.append(turn)
        used += cost
    content = "\n".join(_line(turn) for turn in sorted(chosen, key=lambda t: t.seq))
    messages = [{"role": "system", "content": content}, ask]
    while tokens.count_messages(messages, model=MODEL) > budget and chosen:
        chosen.pop()
        content = "\n".join(_line(turn) for turn in sorted(chosen, key=lambda t: t.seq))
        messages = [{"role": "system", "content": content}, ask]
    return messages


def newest(turns: Sequence[Turn], question: str, budget: int) -> list[dict[str, Any]]:
    """The newest turns as chat messages, then the question, within `budget`."""
    ask = {"role": "user", "content": question}
    kept: list[dict[str, Any]] = []
    for turn in reversed(turns):
        trial = [turn.message(), *kept]
        if tokens.count_messages([*trial, ask], model=MODEL) > budget:
            break
        kept = trial
    return [*kept, ask]


async def fulltext_ranked(engine: AsyncEngine, replayed: Replayed, question: str) -> list[Turn]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT seq FROM nodes WHERE conversation_id = :c AND level = 0 "
                "AND tsv @@ websearch_to_tsquery('english', :q) "
                "ORDER BY ts_rank_cd(tsv, websearch_to_tsquery('english', :q)) DESC, seq"
            ),
            {"c": replayed.conversation_id, "q": retrieval.websearch_query(question)},
        )
        return [replayed.turns[row.seq] for row in rows]


def embedding_ranked(replayed: Replayed, vector: Sequence[float]) -> list[Turn]:
    scores = replayed.embeddings @ np.asarray(vector, dtype=np.float32)
    return [replayed.turns[replayed.embedded[i]] for i in np.argsort(-scores, kind="stable")]


# -- scoring ---------------------------------------------------------------------------------


def present(messages: Sequence[dict[str, Any]], turns: Sequence[Turn]) -> list[bool]:
    prompt = "\n".join(tokens.message_text(m) for m in messages)
    # Surrounding whitespace is not part of what a turn says; the memory message's lines drop it.
    return [turn.text.strip() in prompt for turn in turns]


def _mean(values: Sequence[float]) -> float:
    return round(statistics.fmean(values), 4)


@dataclass
class Scores:
    """Every method's prompts for the questions asked, and their scores.

    `recall[variant][method][budget][group]` holds one recall per question: a variant is a
    choice of evidence (LoCoMo's cited or corrected), a group what the tables break down by."""

    states: States
    budgets: Sequence[int]
    systems: Collection[str] = METHODS
    recall: dict[str, Any] = field(
        default_factory=lambda: defaultdict(
            lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        )
    )
    prompt_tokens: dict[str, dict[int, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    latency: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    by_question: dict[str, dict[str, dict[str, float]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    # Questions per group by the route retrieval took (`Assembled.route`) at the first budget
    # (memstrata_graph's when measured, else memstrata's).
    routes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    async def measure(
        self,
        replayed: Replayed,
        question: str,
        group: str,
        evidence: dict[str, list[Turn]],
        key: str | None = None,
    ) -> None:
        """Build every method's prompt for `question` at every budget and score each against
        each variant's `evidence` (a variant without evidence turns is not scored). With a
        `key`, the first variant's recalls are kept under it too (`by_question`)."""
        plain = self.states.plain
        [vector] = await plain.embedder.embed([question])
        by_embedding = embedding_ranked(replayed, vector)
        by_fulltext = await fulltext_ranked(plain.engine, replayed, question)
        tools_reserved = tools.tool_tokens(MODEL)
        for budget in self.budgets:
            began = time.perf_counter()
            assembled = await self._dry(plain, replayed, question, budget)
            self.latency[budget].append((time.perf_counter() - began) * 1000)
            count = assembled.tokens
            prompts = {"memstrata": assembled.messages}
            routed = assembled
            for method, state in (
                ("memstrata_rebuild", self.states.rebuild),
                ("memstrata_graph", self.states.graph),
                ("memstrata_tools", self.states.offered),
            ):
                if method in self.systems:
                    other = await self._dry(state, replayed, question, budget)
                    prompts[method] = other.messages
                    routed = other if method == "memstrata_graph" else routed
            if budget == self.budgets[0]:
                self.routes[group][routed.route or "none"] += 1
            if "newest" in self.systems:
                prompts["newest"] = newest(replayed.turns, question, budget)
            if "flat_embedding" in self.systems:
                prompts["flat_embedding"] = fill_lines(by_embedding, question, budget)
            if "flat_fulltext" in self.systems:
                prompts["flat_fulltext"] = fill_lines(by_fulltext, question, budget)
            for method, messages in prompts.items():
                used = tokens.count_messages(messages, model=MODEL)
                if method == "memstrata":
                    assert used == count, (used, count)
                limit = budget - (tools_reserved if method == "memstrata_tools" else 0)
                assert used <= limit, (method, used, limit)
                self.prompt_tokens[method][budget].append(used)
                for rank, (variant, turns) in enumerate(evidence.items()):
                    if not turns:
                        continue
                    hits = present(messages, turns)
                    recall = sum(hits) / len(hits)
                    self.recall[variant][method][budget][group].append(recall)
                    if key is not None and rank == 0:
                        self.by_question[key].setdefault(method, {})[str(budget)] = recall

    @staticmethod
    async def _dry(state: State, replayed: Replayed, question: str, budget: int) -> Assembled:
        return await chat.dry_run(
            state,
            tenant_id=state.default_tenant_id,
            external_id=replayed.external_id,
            query=question,
            budget=budget,
            model=MODEL,
        )

    def table(self, variant: str, weights: dict[str, float] | None = None) -> dict[str, Any]:
        """`{method: {budget: {overall, questions, [weighted,] group: mean…}}}` for one
        variant; `weighted` (with `weights`) is the mean of the groups' means so weighted."""
        methods = self.recall[variant]
        table: dict[str, Any] = {}
        for method in (m for m in METHODS if m in methods):
            table[method] = {}
            for budget in self.budgets:
                per = methods[method][budget]
                everything = [v for values in per.values() for v in values]
                cell: dict[str, Any] = {
                    "overall": _mean(everything) if everything else None,
                    "questions": len(everything),
                }
                if weights is not None:
                    total = sum(weights[g] for g in per)
                    cell["weighted"] = round(
                        sum(weights[g] * statistics.fmean(per[g]) for g in per) / total, 4
                    )
                table[method][str(budget)] = cell | {g: _mean(per[g]) for g in sorted(per)}
        return table

    def figures(self) -> dict[str, Any]:
        """Mean prompt tokens per method and budget, the dry run's latency, and the routes
        taken per group."""
        return {
            "routes": {group: dict(counted) for group, counted in sorted(self.routes.items())},
            "prompt_tokens_mean": {
                method: {str(b): round(statistics.fmean(v), 1) for b, v in per.items()}
                for method, per in self.prompt_tokens.items()
            },
            "build_latency_ms": {
                str(b): {
                    "p50": round(percentile(v, 50) or 0.0, 2),
                    "p95": round(percentile(v, 95) or 0.0, 2),
                    "mean": round(statistics.fmean(v), 2),
                }
                for b, v in self.latency.items()
            },
        }
