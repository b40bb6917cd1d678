// The page's frame: the route in the address's hash, the tenant picker, the admin token
// dialog, and which view draws the main panel.
//
//   #/                      conversations (filters in the query: prefix, user, active)
//   #/c/ID[/TAB][?node=N]   one conversation: tree (at node N), search, prompt, graph, jobs
//   #/jobs[?status=S]       the job queue
//   #/tenants               tenants and their keys

import { api, onRefused, session } from "./api.js";
import { errorPanel, h, replace } from "./dom.js";
import { go, route, takeFlash } from "./nav.js";
import { showConversations } from "./conversations.js";
import { showConversation } from "./conversation.js";
import { showJobs } from "./jobs.js";
import { showTenants } from "./tenants.js";

const main = document.getElementById("main");

async function render() {
  const { parts, query } = route();
  const section = parts[0] === "jobs" ? "jobs" : parts[0] === "tenants" ? "tenants" : "conversations";
  for (const link of document.querySelectorAll("#sections a")) {
    if (link.dataset.section === section) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  // Each render draws into a panel of its own: a slower, older one cannot overwrite it.
  const view = h("div", { class: "view" });
  const said = takeFlash();
  replace(main, said ? h("p", { class: "ok", role: "status" }, said) : null, view);
  try {
    if (parts[0] === "c" && parts[1]) await showConversation(view, parts[1], parts[2] || "tree", query);
    else if (section === "jobs") await showJobs(view, { status: query.get("status") || "" });
    else if (section === "tenants") await showTenants(view);
    else await showConversations(view, query);
  } catch (error) {
    replace(view, errorPanel("show this page", error));
  }
}

async function loadTenants() {
  const select = document.getElementById("tenant");
  try {
    const { data } = await api("/tenants", { tenant: false });
    const names = data.map((tenant) => tenant.name);
    if (session.tenant && !names.includes(session.tenant)) session.tenant = "";
    replace(select, data.map((tenant) =>
      h("option", { value: tenant.name }, `${tenant.name} (${tenant.conversations})`)));
    select.value = session.tenant || "default";
    select.disabled = false;
  } catch (error) {
    replace(select, h("option", { value: "" }, "unavailable"));
    select.disabled = true;
    select.title = error.message;
  }
}

function tokenDialog(reason) {
  const dialog = document.getElementById("token-dialog");
  if (dialog.open) return;
  document.getElementById("token-reason").textContent = reason ||
    "The admin API needs MEMSTRATA_ADMIN_TOKEN. It is kept in this tab only (sessionStorage) and sent as a bearer token.";
  const input = document.getElementById("token-input");
  input.value = session.token;
  dialog.showModal();
  input.focus();
}

function wire() {
  const dialog = document.getElementById("token-dialog");
  // The page's routes live in the hash: the skip link moves the focus instead of going there.
  document.getElementById("skip").addEventListener("click", (event) => {
    event.preventDefault();
    main.focus();
  });
  document.getElementById("token-button").addEventListener("click", () => tokenDialog());
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    session.token = document.getElementById("token-input").value.trim();
    dialog.close();
    loadTenants();
    render();
  });
  document.getElementById("token-forget").addEventListener("click", () => {
    session.token = "";
    dialog.close();
    loadTenants();
    render();
  });
  document.getElementById("token-cancel").addEventListener("click", () => dialog.close());
  document.getElementById("tenant").addEventListener("change", (event) => {
    session.tenant = event.target.value === "default" ? "" : event.target.value;
    go("#/");
  });
  onRefused((error) => tokenDialog(`The gateway refused the request: ${error.message}`));
  window.addEventListener("hashchange", () => {
    render();
    main.focus({ preventScroll: true });
  });
  // Tenants may be created on the tenants view: the picker follows.
  window.addEventListener("memstrata:tenants", loadTenants);
}

wire();
loadTenants();
render();
