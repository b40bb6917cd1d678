// The prompt the gateway would send upstream for a question typed here (the admin dry run:
// nothing stored, nothing sent): the working context's parts coloured (the client's system
// prompt, stable memory, verbatim turns, the recall note, the new message), each with its
// messages and tokens, how much of it repeats the last prompt sent, and for every message the
// recall note quotes why it was picked (its rank once fused, and in each leg).

import { api } from "./api.js";
import { empty, errorPanel, field, h, number, percent, replace } from "./dom.js";
import { link } from "./nav.js";

const NAMES = {
  system: "System prompt",
  stable: "Stable memory",
  memory: "Memory (rebuilt per query)",
  verbatim: "Verbatim turns",
  note: "Recall note",
  new: "New message",
  history: "History as stored",
};

export async function showPrompt(panel, id) {
  const query = h("textarea", { name: "query", rows: 3, required: true, placeholder: "Type the next user message…" });
  const budget = h("input", { type: "number", name: "budget", min: 1, placeholder: "default", inputmode: "numeric" });
  const model = h("input", { type: "text", name: "model", value: "gpt-4o", autocomplete: "off" });
  const result = h("div", { class: "prompt-result", "aria-live": "polite" });
  const form = h(
    "form", { class: "filters prompt-form", "aria-label": "Dry-run a prompt" },
    field("Next message", query), field("Budget (tokens)", budget), field("Model", model),
    h("button", { type: "submit" }, "Show the prompt"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    replace(result, h("p", { class: "muted loading", role: "status" }, "Building the prompt…"));
    try {
      const body = { query: query.value, model: model.value.trim() || "gpt-4o" };
      if (budget.value) body.budget = Number(budget.value);
      const built = await api(`/conversations/${encodeURIComponent(id)}/context`, { method: "POST", body });
      replace(result, draw(built, id));
    } catch (error) {
      replace(result, errorPanel("build the prompt", error));
    }
  });
  replace(
    panel,
    h("p", { class: "muted" }, "A dry run: what would go upstream if this conversation received the message now. Nothing is stored or sent."),
    form, result,
  );
  query.focus();
}

function draw(built, id) {
  const parts = built.parts;
  const counted = parts.reduce((sum, part) => sum + part.tokens, 0);
  return h(
    "div", {},
    h("p", { class: "prompt-total" },
      h("strong", { "data-total": built.tokens }, `${number(built.tokens)} tokens`),
      ` in ${number(built.messages.length)} messages (parts ${number(counted)} + reply priming ${number(built.tokens - counted)})`),
    h("p", { class: "muted reuse" },
      `Repeats ${percent(built.reuse)} of the last prompt sent (${number(built.reused_tokens)} tokens, what a provider can cache)`,
      built.working_context ? " · from the working context" : "",
      built.compacted ? " · the working context would be compacted" : "",
      built.prepared_recall ? " · recall prepared after the last reply" : ""),
    bar(parts, counted),
    h("ol", { class: "parts" }, parts.map((part, index) => partView(part, index, built))),
    recalled(built.recalled, id),
  );
}

function bar(parts, counted) {
  if (!counted) return null;
  const bar = h("div", { class: "part-bar", role: "img", "aria-label": parts.map((p) => `${NAMES[p.label] || p.label} ${p.tokens} tokens`).join(", ") });
  for (const part of parts) {
    const piece = h("span", { class: `part-${part.label}`, title: `${NAMES[part.label] || part.label}: ${part.tokens} tokens` });
    piece.style.flexGrow = String(part.tokens || 0);
    bar.append(piece);
  }
  return bar;
}

function partView(part, index, built) {
  const messages = built.messages.slice(part.start, part.start + part.messages);
  return h(
    "li", { class: `part part-${part.label}`, dataset: { label: part.label, tokens: part.tokens } },
    // The long parts start folded: the short ones say what this turn adds.
    h("details", { open: ["system", "note", "new"].includes(part.label) },
      h("summary", {},
        h("span", { class: "part-name" }, NAMES[part.label] || part.label),
        h("span", { class: "part-count" }, `${number(part.messages)} message${part.messages === 1 ? "" : "s"}`),
        h("span", { class: "part-tokens" }, `${number(part.tokens)} tokens`)),
      messages.map((message) => h(
        "div", { class: "prompt-message" },
        h("div", { class: "node-head" }, h("strong", {}, message.role), message.name ? ` (${message.name})` : ""),
        h("div", { class: "verbatim" }, text(message)),
      ))),
  );
}

function text(message) {
  const content = message.content;
  let shown = typeof content === "string" ? content
    : Array.isArray(content) ? content.map((part) => (part.type === "text" ? part.text : `[${part.type}]`)).join("\n") : "";
  if (typeof message.refusal === "string" && message.refusal) shown += `${shown ? "\n" : ""}refused: ${message.refusal}`;
  const calls = [...(message.tool_calls || []).map((call) => call.function), message.function_call];
  for (const fn of calls.filter((one) => one && typeof one === "object")) shown += `\n→ ${fn.name}(${fn.arguments || ""})`;
  return shown || "(no text)";
}

function recalled(why, id) {
  const heading = h("h2", {}, "Why the recall note quotes each message");
  if (!why.length) return h("section", { class: "why" }, heading, empty("No past message was recalled for this question: the conversation fits, nothing bore on it, or it asks nothing (a statement gets no note)."));
  return h(
    "section", { class: "why" }, heading,
    h("p", { class: "muted" }, "Rank once the legs are fused (1: the best of every candidate), then each leg that found it. A message no leg found was lent part of a neighbour's score (the answer after a matching question); a pinned milestone is in every prompt."),
    h("ol", { class: "why-list" }, why.map((one) => h(
      "li", { dataset: { nodeId: one.node_id } },
      h("a", { href: link(["c", id, "tree"], { node: one.node_id }) }, `message ${one.seq}`),
      h("span", { class: "rank" }, `rank ${number(one.rank)}`),
      h("span", { class: "muted" }, `score ${one.score.toFixed(4)}`),
      one.legs.map((leg) => h("span", { class: "chip leg" },
        `${leg.leg} #${leg.rank}${leg.similarity === null ? "" : ` (${leg.similarity.toFixed(2)})`}`)),
      one.exact ? h("span", { class: "mark" }, "exact identifier") : null,
      one.standout ? h("span", { class: "mark" }, "standout") : null,
      one.lent ? h("span", { class: "mark" }, "lent by a neighbour") : null,
      one.pinned ? h("span", { class: "mark pinned" }, "pinned milestone") : null,
    ))),
  );
}
