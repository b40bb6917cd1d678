// The concept graph of a conversation (`GET /admin/conversations/{id}/graph`), once the
// gateway builds one: concepts as circles sized by frequency on rings (the most frequent in
// the middle; no force simulation), schematic ones highlighted, edges as lines. Choosing a
// concept lists the messages that mention it. Until the endpoint exists (or while the
// conversation has no graph) it answers 404, and the page says there is no graph yet.

import { api } from "./api.js";
import { empty, errorPanel, h, number, replace } from "./dom.js";
import { link } from "./nav.js";

const SVG = "http://www.w3.org/2000/svg";
const SIZE = 640;

export async function showGraph(panel, id) {
  replace(panel, h("p", { class: "muted loading", role: "status" }, "Loading the graph…"));
  let graph;
  try {
    graph = await api(`/conversations/${encodeURIComponent(id)}/graph`);
  } catch (error) {
    if (error.status === 404) {
      replace(panel, empty("No graph yet: concepts and their edges appear here once the gateway has built this conversation's concept graph."));
    } else {
      replace(panel, errorPanel("load the graph", error));
    }
    return;
  }
  const concepts = (graph.concepts || graph.nodes || []).map(concept);
  if (!concepts.length) {
    replace(panel, empty("No graph yet: no concept has been extracted from this conversation."));
    return;
  }
  const edges = (graph.edges || []).map((edge) => ({
    source: String(edge.source),
    target: String(edge.target),
    kind: edge.kind || "",
    weight: Number(edge.weight ?? 1),
  }));
  const detail = h("div", { class: "concept-detail", "aria-live": "polite" }, h("p", { class: "muted" }, "Choose a concept to list the messages that mention it."));
  replace(
    panel,
    h("p", { class: "muted" }, `${number(concepts.length)} concepts, ${number(edges.length)} edges`,
      graph.version !== undefined ? ` · version ${graph.version}` : "",
      graph.scope ? ` · scope ${graph.scope}` : "",
      " · schematic concepts are highlighted; co-occurrence edges solid, precedes dashed"),
    h("div", { class: "graph" }, drawing(concepts, edges, (chosen) => mentions(detail, id, chosen)), detail),
  );
}

// A concept as `GET /admin/conversations/{id}/graph` gives it: `mentions` counts the nodes of
// the conversation that mention it (a list of them, where an answer carries one, is used as is).
function concept(raw) {
  return {
    id: String(raw.id ?? raw.name),
    name: String(raw.name ?? raw.label ?? raw.id),
    frequency: Number(raw.frequency ?? 1),
    schematic: Boolean(raw.schematic),
    mentioned: typeof raw.mentions === "number" ? raw.mentions : null,
    mentions: Array.isArray(raw.mentions) ? raw.mentions : null,
  };
}

function svg(tag, attrs, ...children) {
  const element = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) element.setAttribute(key, String(value));
  element.append(...children);
  return element;
}

// Rings: 1 concept in the centre, then rings of 8, 16, 24…, most frequent first.
function place(concepts) {
  const sorted = [...concepts].sort((a, b) => b.frequency - a.frequency || a.name.localeCompare(b.name));
  const at = new Map();
  let index = 0;
  for (let ring = 0; index < sorted.length; ring += 1) {
    const count = ring === 0 ? 1 : 8 * ring;
    const radius = ring * 70;
    for (let slot = 0; slot < count && index < sorted.length; slot += 1, index += 1) {
      const angle = (2 * Math.PI * slot) / count + ring * 0.4;
      at.set(sorted[index].id, { x: radius * Math.cos(angle), y: radius * Math.sin(angle) });
    }
  }
  return at;
}

function drawing(concepts, edges, choose) {
  const at = place(concepts);
  const extent = Math.max(120, ...[...at.values()].map((p) => Math.max(Math.abs(p.x), Math.abs(p.y)))) + 60;
  const most = Math.max(...concepts.map((c) => c.frequency));
  const lines = edges.filter((e) => at.has(e.source) && at.has(e.target)).map((e) => {
    const line = svg("line", {
      x1: at.get(e.source).x, y1: at.get(e.source).y, x2: at.get(e.target).x, y2: at.get(e.target).y,
      class: `edge ${e.kind}`.trim(),
    });
    line.style.strokeWidth = String(1 + Math.log2(Math.max(1, e.weight)));
    return line;
  });
  const dots = concepts.map((c) => {
    const { x, y } = at.get(c.id);
    const group = svg("g", { class: c.schematic ? "concept schematic" : "concept", tabindex: 0, role: "button", "aria-label": `${c.name}, ${c.frequency} mentions${c.schematic ? ", schematic" : ""}`, "data-concept": c.id },
      svg("circle", { cx: x, cy: y, r: 8 + 16 * Math.sqrt(c.frequency / most) }),
      svg("text", { x, y: y + 30, "text-anchor": "middle" }, c.name));
    const pick = () => {
      for (const other of group.parentNode.querySelectorAll(".concept.chosen")) other.classList.remove("chosen");
      group.classList.add("chosen");
      choose(c);
    };
    group.addEventListener("click", pick);
    group.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") { event.preventDefault(); pick(); }
    });
    return group;
  });
  return svg("svg", { viewBox: `${-extent} ${-extent} ${2 * extent} ${2 * extent}`, width: SIZE, class: "graph-drawing", role: "group", "aria-label": "Concept graph" },
    svg("g", {}, ...lines), svg("g", {}, ...dots));
}

// The messages that mention a concept: those the graph lists, else found by searching for it.
async function mentions(detail, id, chosen) {
  replace(detail, h("h2", {}, chosen.name), h("p", { class: "muted loading" }, "Loading mentions…"));
  try {
    let items;
    let note;
    if (Array.isArray(chosen.mentions)) {
      items = chosen.mentions.map((m) => (typeof m === "object" ? m : { node_id: m }));
      note = `${number(items.length)} messages mention it`;
    } else {
      // The hybrid search also finds neighbours and near meanings: keep those that name it.
      const name = chosen.name.toLowerCase();
      const found = (await api("/search", { params: { q: chosen.name, conversation: id, level: [0], limit: 50 } })).data;
      items = found.filter((hit) => hit.text.toLowerCase().includes(name));
      note = "Messages that name it, found by searching for it";
      if (chosen.mentioned !== null) note += ` (the graph counts ${number(chosen.mentioned)} mentions)`;
    }
    replace(
      detail, h("h2", {}, chosen.name),
      h("p", { class: "muted" }, `${note} · frequency ${number(chosen.frequency)}${chosen.schematic ? " · schematic" : ""}`),
      items.length ? h("ul", { class: "mentions" }, items.map((m) => h("li", {},
        h("a", { href: link(["c", id, "tree"], { node: m.node_id ?? m.id }) }, m.seq !== undefined ? `message ${m.seq}` : `node #${m.node_id ?? m.id}`),
        m.text ? ` ${m.text.slice(0, 160)}${m.text.length > 160 ? "…" : ""}` : ""))) : empty("No message found."),
    );
  } catch (error) {
    replace(detail, errorPanel(`list the messages that mention ${chosen.name}`, error));
  }
}
