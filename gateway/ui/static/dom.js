// Small DOM helpers: elements built from data (text only, never parsed as HTML), numbers and
// times in words, and the panels every view shares (loading, errors, empty states).

import { ApiError } from "./api.js";

// h("a", {href: "#/", class: "x", onclick: f}, "text", child, [more]) -> element.
export function h(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      element.addEventListener(key.slice(2), value);
    } else if (key === "dataset") {
      Object.assign(element.dataset, value);
    } else {
      element.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

// The tree's levels by name (SPEC §5: 8 segments make a core, 8 cores a sphere).
export function levelName(level, plural = false) {
  const names = [["message", "messages"], ["segment", "segments"], ["core", "cores"], ["sphere", "spheres"]];
  const [one, many] = names[level] || [`level-${level} summary`, `level-${level} summaries`];
  return plural ? many : one;
}

export function replace(element, ...children) {
  element.replaceChildren();
  append(element, children);
  return element;
}

export const number = (value) =>
  value === null || value === undefined ? "–" : Number(value).toLocaleString("en-US");

export const ratio = (value) =>
  value === null || value === undefined ? "–" : `${Number(value).toFixed(1)}×`;

export const percent = (value) =>
  value === null || value === undefined ? "–" : `${(100 * Number(value)).toFixed(0)}%`;

// A time as "2026-03-14 09:30" (UTC, as the memory tools show it).
export function when(value) {
  if (!value) return "–";
  const date = new Date(value);
  if (Number.isNaN(date.getTime())) return String(value);
  return date.toISOString().slice(0, 16).replace("T", " ");
}

export function timeTag(value) {
  return h("time", { datetime: value || "" }, when(value));
}

export function loading(what) {
  return h("p", { class: "muted loading", role: "status" }, `Loading ${what}…`);
}

// An error in words, for a panel that could not be drawn.
export function errorPanel(what, error) {
  const text = error instanceof ApiError ? error.describe() : String(error && error.message || error);
  return h("div", { class: "error", role: "alert" }, h("strong", {}, `Could not ${what}. `), text);
}

export function empty(text) {
  return h("p", { class: "empty" }, text);
}

// Runs `load` and draws its result into `target`, an error in words if it fails.
export async function panel(target, what, load, draw) {
  replace(target, loading(what.replace(/^(load|show|read) /, "")));
  try {
    const data = await load();
    replace(target, draw(data));
  } catch (error) {
    replace(target, errorPanel(what, error));
  }
}

export function field(label, input) {
  return h("label", { class: "field" }, h("span", {}, label), input);
}

// A key figure: a label above a value.
export function stat(label, value, title, size = "") {
  return h("div", { class: `stat ${size}`.trim(), title, dataset: { stat: label } }, h("dt", {}, label), h("dd", {}, value));
}

// A table whose rows turn into cards on narrow screens (each cell names its column).
export function table(columns, rows, { caption, rowAttrs } = {}) {
  return h(
    "div", { class: "table-wrap" },
    h(
      "table", { class: "cards" },
      caption ? h("caption", { class: "sr-only" }, caption) : null,
      h("thead", {}, h("tr", {}, columns.map(([name]) => h("th", { scope: "col" }, name)))),
      h("tbody", {}, rows.map((row) =>
        h("tr", rowAttrs ? rowAttrs(row) : {},
          columns.map(([name, cell]) => h("td", { "data-label": name }, cell(row)))))),
    ),
  );
}

// Asks before something that cannot be undone; resolves true on "yes".
export function confirmDialog(title, text, yes = "Delete") {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-yes").textContent = yes;
  const opener = document.activeElement;
  return new Promise((resolve) => {
    const form = document.getElementById("confirm-form");
    const no = document.getElementById("confirm-no");
    const done = (answer) => {
      form.removeEventListener("submit", onYes);
      no.removeEventListener("click", onNo);
      dialog.removeEventListener("cancel", onNo);
      dialog.close();
      if (opener && opener.focus) opener.focus();
      resolve(answer);
    };
    const onYes = (event) => { event.preventDefault(); done(true); };
    const onNo = (event) => { event.preventDefault(); done(false); };
    form.addEventListener("submit", onYes);
    no.addEventListener("click", onNo);
    dialog.addEventListener("cancel", onNo);
    dialog.showModal();
    no.focus();
  });
}
