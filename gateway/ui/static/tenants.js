// Tenants and their gateway keys: create a tenant, create a key (its secret shown this once),
// revoke a key, delete a tenant with everything it owns (each deletion asks first).

import { api } from "./api.js";
import { confirmDialog, empty, errorPanel, field, h, number, replace, table, timeTag } from "./dom.js";

export async function showTenants(view) {
  const notice = h("div", { role: "status", "aria-live": "polite" });
  const list = h("div");
  const name = h("input", { type: "text", name: "name", required: true, pattern: "[A-Za-z0-9._\\-]{1,64}", placeholder: "acme", autocomplete: "off" });
  const form = h("form", { class: "filters", "aria-label": "Create a tenant" }, field("New tenant", name), h("button", { type: "submit" }, "Create tenant"));
  const load = async () => {
    replace(list, h("p", { class: "muted loading", role: "status" }, "Loading tenants…"));
    try {
      const { data } = await api("/tenants", { tenant: false });
      replace(list, tenantsTable(data, { notice, load }));
    } catch (error) {
      replace(list, errorPanel("load the tenants", error));
    }
  };
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const created = await api("/tenants", { method: "POST", body: { name: name.value.trim() }, tenant: false });
      replace(notice, h("p", { class: "ok" }, `Tenant ${created.name} created.`));
      name.value = "";
      window.dispatchEvent(new Event("memstrata:tenants"));
      await load();
    } catch (error) {
      replace(notice, errorPanel("create the tenant", error));
    }
  });
  replace(view, h("h1", {}, "Tenants and keys"), form, notice, list);
  await load();
}

function tenantsTable(tenants, { notice, load }) {
  const columns = [
    ["Tenant", (t) => h("strong", {}, t.name)],
    ["Conversations", (t) => number(t.conversations)],
    ["Active keys", (t) => number(t.active_keys)],
    ["Created", (t) => timeTag(t.created_at)],
    ["", (t) => h("div", { class: "actions" },
      h("button", { type: "button", class: "quiet", "aria-expanded": "false", onclick: (event) => toggleKeys(event.currentTarget, t, notice) }, "Keys"),
      t.name === "default" ? null : h("button", { type: "button", class: "danger", onclick: () => removeTenant(t, notice, load) }, "Delete…"))],
  ];
  return table(columns, tenants, { caption: "Tenants", rowAttrs: (t) => ({ dataset: { tenant: t.name } }) });
}

async function removeTenant(tenant, notice, load) {
  const sure = await confirmDialog(`Delete tenant ${tenant.name}?`,
    `Its ${tenant.conversations} conversations, their messages and summaries, its keys and jobs are deleted for good.`, "Delete tenant");
  if (!sure) return;
  try {
    await api(`/tenants/${encodeURIComponent(tenant.name)}`, { method: "DELETE", tenant: false });
    replace(notice, h("p", { class: "ok" }, `Tenant ${tenant.name} deleted.`));
    window.dispatchEvent(new Event("memstrata:tenants"));
    await load();
  } catch (error) {
    replace(notice, errorPanel(`delete tenant ${tenant.name}`, error));
  }
}

// The tenant's keys in a row under its own, opened and closed by its "Keys" button.
async function toggleKeys(button, tenant, notice) {
  const row = button.closest("tr");
  const open = row.nextElementSibling?.classList.contains("keys-row") ? row.nextElementSibling : null;
  if (open) {
    open.remove();
    button.setAttribute("aria-expanded", "false");
    return;
  }
  const cell = h("td", { colspan: row.children.length });
  row.after(h("tr", { class: "keys-row" }, cell));
  button.setAttribute("aria-expanded", "true");
  await drawKeys(cell, tenant, notice);
}

async function drawKeys(cell, tenant, notice) {
  const base = `/tenants/${encodeURIComponent(tenant.name)}/keys`;
  const secret = h("div", { "aria-live": "polite" });
  const label = h("input", { type: "text", name: "key-name", placeholder: "what it is for", autocomplete: "off" });
  const form = h("form", { class: "filters", "aria-label": `Create a key for ${tenant.name}` }, field("Key name", label), h("button", { type: "submit" }, "Create key"));
  const list = h("div");
  const load = async () => {
    try {
      const { data } = await api(base, { tenant: false });
      replace(list, data.length ? table([
        ["Prefix", (k) => h("code", {}, k.prefix)],
        ["Name", (k) => k.name || "–"],
        ["Created", (k) => timeTag(k.created_at)],
        ["Revoked", (k) => (k.revoked_at ? timeTag(k.revoked_at) : "active")],
        ["", (k) => (k.revoked_at ? null : h("button", { type: "button", class: "danger", onclick: () => revoke(k) }, "Revoke…"))],
      ], data, { caption: `Keys of ${tenant.name}` }) : empty("No keys yet."));
    } catch (error) {
      replace(list, errorPanel("load the keys", error));
    }
  };
  const revoke = async (key) => {
    if (!(await confirmDialog(`Revoke key ${key.prefix}…?`, "Requests with it are refused from the next one on.", "Revoke key"))) return;
    try {
      await api(`${base}/${key.id}`, { method: "DELETE", tenant: false });
      replace(notice, h("p", { class: "ok" }, `Key ${key.prefix}… revoked.`));
      await load();
    } catch (error) {
      replace(notice, errorPanel("revoke the key", error));
    }
  };
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const created = await api(base, { method: "POST", body: { name: label.value.trim() }, tenant: false });
      label.value = "";
      replace(secret, h("div", { class: "secret", role: "alert" },
        h("p", {}, h("strong", {}, "Copy this key now: it is shown this once."), " Only its hash is stored."),
        h("code", { class: "key" }, created.key)));
      await load();
    } catch (error) {
      replace(secret, errorPanel("create the key", error));
    }
  });
  replace(cell, form, secret, list);
  await load();
}
