// The dashboard's page: renders the snapshot the server embedded, then follows /events
// (server-sent events: a snapshot, then diffs) without reloading. Every value goes into the
// DOM as text (textContent), never as HTML. Writes carry the session's CSRF token from the
// meta tag in the X-CSRF-Token header; the session itself is an HttpOnly cookie.
"use strict";

const state = { rollouts: {}, order: [], learns: [], fleet: {}, devices: null, error: null };
const view = { group: "", q: "", state: "all", page: 1 };
let source = null;

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}

function csrf() { return document.querySelector('meta[name="csrf-token"]').content; }
function say(text, bad) {
  const m = document.getElementById("message");
  m.textContent = text; m.className = bad ? "error" : "ok";
}

async function post(path, body) {
  const r = await fetch(path, {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf() },
    body: JSON.stringify(body || {}),
  });
  let out = {};
  try { out = await r.json(); } catch (e) { out = { error: r.statusText }; }
  if (!r.ok) throw new Error(out.error || r.statusText);
  return out;
}

// --- rendering -------------------------------------------------------------------------

function renderCounts() {
  const f = state.fleet, c = document.getElementById("counts");
  c.replaceChildren(...[["devices", f.devices], ["online", f.online], ["offline", f.offline],
    ["need attention", f.attention], ["running a job", f.running]].map(
      ([k, v]) => el("span", { class: "count", "data-count": k }, el("b", { text: String(v ?? 0) }), " " + k)));
  const sel = document.getElementById("f-group"), want = view.group;
  const groups = Object.keys(f.groups || {});
  sel.replaceChildren(el("option", { value: "", text: "all" }),
    ...groups.map((g) => el("option", { value: g, text: `${g} (${f.groups[g]})` })));
  sel.value = want;
}

function renderDevices() {
  const d = state.devices; if (!d) return;
  const body = document.querySelector("#devices tbody");
  body.replaceChildren(...d.rows.map((r) => el("tr", { "data-device": r.device, class: r.attention ? "attention" : "" },
    el("td", { text: r.device }), el("td", { class: r.online ? "on" : "off", text: r.online ? "online" : "offline" }),
    el("td", { text: r.groups.join(", ") }), el("td", { text: r.model ?? "–" }),
    el("td", { text: r.job ?? "–" }), el("td", { text: r.temp_c == null ? "–" : String(r.temp_c) }),
    el("td", { text: r.attention ?? "" }))));
  document.getElementById("page-of").textContent = `page ${d.page} of ${d.pages} (${d.matches} devices)`;
}

function bar(w) {
  const done = w.succeeded + w.failed + w.canceled, pct = w.devices ? (100 * done / w.devices) : 0;
  const b = el("div", { class: "bar", title: `${done}/${w.devices}` });
  b.append(el("div", { class: "ok" }), el("div", { class: "bad" }));
  b.children[0].style.width = `${w.devices ? 100 * w.succeeded / w.devices : 0}%`;
  b.children[1].style.width = `${w.devices ? 100 * w.failed / w.devices : 0}%`;
  return el("span", {}, b, ` ${done}/${w.devices} (${pct.toFixed(0)}%)`);
}

function buttons(r) {
  const box = el("span", { class: "buttons" });
  if (document.body.dataset.writable !== "yes") return box;
  const going = ["running", "paused", "waiting_approval"].includes(r.state);
  const show = { approve: r.state === "waiting_approval", pause: r.state === "running",
    resume: r.state === "paused", abort: going };
  for (const verb of ["approve", "pause", "resume", "abort"]) {
    if (!show[verb]) continue;
    const b = el("button", { type: "button", class: `act ${verb}`, "data-verb": verb, "data-rollout": r.id,
      text: verb === "approve" ? `approve wave ${r.waiting_wave}` : verb });
    b.disabled = document.body.dataset.loggedIn !== "yes";
    if (b.disabled) b.title = "log in with the operator token first";
    box.append(b);
  }
  return box;
}

function rolloutCard(r) {
  const head = el("h3", {}, el("span", { class: "rid", text: r.id }), " ",
    el("span", { class: `state s-${r.state}`, "data-state": r.state, text: r.state }),
    ` ${r.job} → ${r.group}, ${r.targets} devices`, buttons(r));
  const notes = [];
  if (r.reason) notes.push(r.reason);
  if (r.waiting_wave !== null) notes.push(`wave ${r.waiting_wave} waits for an operator's approval`);
  if (r.request) notes.push(`request posted: ${r.request}`);
  if (r.rate_per_minute !== null) notes.push(`rate ${r.rate_per_minute}/min`);
  const waves = el("table", { class: "waves" }, el("thead", {}, el("tr", {},
    ...["wave", "state", "progress", "sent", "running", "deferred", "succeeded", "failed"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...r.waves.map((w) => el("tr", { "data-wave": String(w.wave) },
      el("td", { text: String(w.wave) }), el("td", { class: `state s-${w.state}`, "data-state": w.state, text: w.state }),
      el("td", {}, bar(w)), ...["sent", "running", "deferred", "succeeded", "failed"].map((k) => el("td", { "data-k": k, text: String(w[k]) }))))));
  const card = el("article", { class: "rollout", id: `rollout-${r.id}`, "data-state": r.state }, head,
    notes.length ? el("p", { class: "notes", text: notes.join(" · ") }) : null, waves);
  if (r.failed_total) {
    card.append(el("details", { class: "failures", open: "" }, el("summary", { text: `failed devices (${r.failed_total})` }),
      el("table", {}, el("tbody", {}, ...r.failures.map((f) => el("tr", {},
        el("td", { text: f.device }), el("td", { text: `wave ${f.wave}` }), el("td", { text: f.status }),
        el("td", { text: f.code ?? "" }), el("td", { text: f.message ?? "" }))))),
      r.failed_total > r.failures.length ? el("p", { class: "muted", text: `… and ${r.failed_total - r.failures.length} more: fleetctl rollout status ${r.id}` }) : null));
  }
  return card;
}

function renderRollouts(changed) {
  const box = document.getElementById("rollouts");
  const keep = new Set(state.order);
  for (const c of [...box.children]) if (!keep.has(c.dataset.rid)) c.remove();
  let prev = null;
  for (const id of state.order) {
    let wrap = box.querySelector(`:scope > [data-rid="${CSS.escape(id)}"]`);
    if (!wrap) { wrap = el("div", { "data-rid": id }); changed = changed || new Set(); changed.add(id); }
    if (!changed || changed.has(id)) wrap.replaceChildren(rolloutCard(state.rollouts[id]));
    if (prev ? prev.nextSibling !== wrap : box.firstChild !== wrap) box.insertBefore(wrap, prev ? prev.nextSibling : box.firstChild);
    prev = wrap;
  }
  if (!state.order.length) box.replaceChildren(el("p", { class: "muted", text: "no rollouts" }));
}

function curve(points) {
  // Accuracy per round: the base (grey) and the candidate (blue), 0-100 %.
  const W = 320, H = 120, P = 24, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.setAttribute("class", "curve");
  svg.setAttribute("role", "img"); svg.setAttribute("aria-label", "accuracy per round");
  const n = Math.max(points.length, 2), x = (i) => P + i * (W - 2 * P) / (n - 1);
  const vals = points.flatMap((p) => [p.base, p.candidate]).filter((v) => v != null);
  const lo = vals.length ? Math.max(0, Math.min(...vals) - 0.05) : 0, hi = vals.length ? Math.min(1, Math.max(...vals) + 0.05) : 1;
  const y = (v) => H - P - (v - lo) / ((hi - lo) || 1) * (H - 2 * P);
  const axis = document.createElementNS(ns, "path");
  axis.setAttribute("d", `M${P} ${P}V${H - P}H${W - P}`); axis.setAttribute("class", "axis"); svg.append(axis);
  for (const [key, cls] of [["base", "base"], ["candidate", "cand"]]) {
    const pts = points.map((p, i) => [i, p[key]]).filter(([, v]) => v != null);
    if (!pts.length) continue;
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.map(([i, v]) => `${x(i)},${y(v)}`).join(" "));
    line.setAttribute("class", cls); svg.append(line);
    for (const [i, v] of pts) {
      const c = document.createElementNS(ns, "circle");
      c.setAttribute("cx", x(i)); c.setAttribute("cy", y(v)); c.setAttribute("r", 3); c.setAttribute("class", cls);
      const t = document.createElementNS(ns, "title"); t.textContent = `round ${points[i].round} ${key}: ${(100 * v).toFixed(1)}%`;
      c.append(t); svg.append(c);
    }
  }
  for (const [v, cls] of [[lo, "lo"], [hi, "hi"]]) {
    const t = document.createElementNS(ns, "text"); t.setAttribute("x", 2); t.setAttribute("y", y(v) + 4);
    t.textContent = `${(100 * v).toFixed(0)}%`; t.setAttribute("class", `tick ${cls}`); svg.append(t);
  }
  return svg;
}

function pct(v) { return v == null ? "–" : `${(100 * v).toFixed(1)}%`; }

function learnCard(l) {
  const head = el("h3", {}, el("span", { class: "rid", text: l.id }), " ",
    el("span", { class: `state s-${l.state}`, text: l.state }),
    ` round ${l.round} of ${l.rounds}, base ${l.base} (${l.model})`);
  const rows = l.curve.map((p) => el("tr", {}, el("td", { text: String(p.round) }),
    el("td", { text: p.phase }), el("td", { text: p.outcome ?? "" }), el("td", { text: pct(p.base) }),
    el("td", { text: pct(p.candidate) }), el("td", { text: p.release ?? "" })));
  const table = el("table", { class: "rounds" },
    el("thead", {}, el("tr", {}, ...["round", "phase", "outcome", "base", "candidate", "release"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
  return el("article", { class: "learn", id: `learn-${l.id}` }, head,
    l.reason ? el("p", { class: "notes", text: l.reason }) : null,
    el("div", { class: "learn-body" }, curve(l.curve), table));
}

function renderLearns() {
  const box = document.getElementById("learns");
  if (!state.learns.length) { box.replaceChildren(el("p", { class: "muted", text: "no learns" })); return; }
  box.replaceChildren(...state.learns.map(learnCard));
}

function renderError() {
  const e = document.getElementById("db-error");
  e.hidden = !state.error; e.textContent = state.error ? `state db: ${state.error}` : "";
}

function apply(msg, full) {
  let changed = null;
  if (full) { Object.assign(state, msg); state.rollouts = msg.rollouts; }
  else {
    if (msg.rollouts) { changed = new Set(Object.keys(msg.rollouts)); Object.assign(state.rollouts, msg.rollouts); }
    for (const k of ["order", "learns", "fleet", "devices", "error"]) if (k in msg) state[k] = msg[k];
    if (msg.order) for (const id of Object.keys(state.rollouts)) if (!msg.order.includes(id)) delete state.rollouts[id];
  }
  if (full || msg.fleet) renderCounts();
  if (full || msg.devices) renderDevices();
  if (full || msg.rollouts || msg.order) renderRollouts(full ? null : (changed || new Set()));
  if (full || msg.learns) renderLearns();
  if (full || "error" in msg) renderError();
  document.body.dataset.version = String(msg.version ?? "");
}

// --- live updates -------------------------------------------------------------------------

function query() { return new URLSearchParams({ group: view.group, q: view.q, state: view.state, page: String(view.page) }).toString(); }

function follow() {
  if (source) source.close();
  const live = document.getElementById("live");
  source = new EventSource(`/events?${query()}`);
  source.addEventListener("snapshot", (e) => { apply(JSON.parse(e.data), true); live.textContent = "live"; live.className = "live on"; });
  source.addEventListener("diff", (e) => apply(JSON.parse(e.data), false));
  source.onerror = () => { live.textContent = "reconnecting…"; live.className = "live off"; };
}

function setView(change) {
  Object.assign(view, change);
  follow();
}

// --- operator -----------------------------------------------------------------------------

function setLoggedIn(yes, token) {
  document.body.dataset.loggedIn = yes ? "yes" : "no";
  document.querySelector('meta[name="csrf-token"]').content = token || "";
  const form = document.getElementById("login-form"), who = document.getElementById("who");
  if (form) form.hidden = yes;
  if (who) who.hidden = !yes;
  renderRollouts(null);
}

function wire() {
  const form = document.getElementById("login-form");
  if (form) form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const t = document.getElementById("token");
    try {
      const out = await post("/login", { token: t.value });
      t.value = ""; setLoggedIn(true, out.csrf); say("logged in");
    } catch (err) { say(err.message, true); }
  });
  const out = document.getElementById("logout");
  if (out) out.addEventListener("click", async () => {
    try { await post("/logout"); setLoggedIn(false, ""); say("logged out"); } catch (err) { say(err.message, true); }
  });
  document.getElementById("rollouts").addEventListener("click", async (e) => {
    const b = e.target.closest("button.act"); if (!b) return;
    const verb = b.dataset.verb, rid = b.dataset.rollout;
    if (verb === "abort" && !window.confirm(`Abort rollout ${rid}?`)) return;
    b.disabled = true;
    try { await post(`/rollouts/${encodeURIComponent(rid)}/${verb}`); say(`${verb} posted for ${rid}`); }
    catch (err) { say(err.message, true); b.disabled = false; }
  });
  document.getElementById("f-group").addEventListener("change", (e) => setView({ group: e.target.value, page: 1 }));
  document.getElementById("f-state").addEventListener("change", (e) => setView({ state: e.target.value, page: 1 }));
  let typing = null;
  document.getElementById("f-q").addEventListener("input", (e) => {
    clearTimeout(typing); typing = setTimeout(() => setView({ q: e.target.value.trim(), page: 1 }), 250);
  });
  document.getElementById("filter").addEventListener("submit", (e) => e.preventDefault());
  document.getElementById("prev").addEventListener("click", () => { if (view.page > 1) setView({ page: view.page - 1 }); });
  document.getElementById("next").addEventListener("click", () => { if (state.devices && view.page < state.devices.pages) setView({ page: view.page + 1 }); });
}

wire();
apply(JSON.parse(document.getElementById("initial").textContent), true);
performance.mark("dashboard-rendered");  // the first paint with the fleet on it (benchmarks)
follow();
