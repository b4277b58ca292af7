// kvserve's page: a chat that streams, and what the cache did for it.
//
// It uses only the public API (/v1/models, /v1/chat/completions, /v1/cache/*, /replicas) and
// /metrics, with the key the user gives (sent as a bearer token). Everything a prompt, an
// answer, a tool call or a tenant can put on the page is set as text (textContent, text
// nodes): nothing is ever parsed as HTML, and the page's Content Security Policy allows no
// inline script. The prefix tree and the tenants are shown only when the server answers them,
// that is to its admin (kvserve/server/auth.py).
"use strict";

const state = {
  key: sessionStorage.getItem("kvserve-key") || "",
  session: null,   // GET /ui/session: key_required, key_accepted, admin, gateway
  admin: false,
  ready: false,
  history: [],
  usage: [],       // KV pool use over time (fractions), newest last
  busy: false,
};
const $ = (id) => document.getElementById(id);

// An element with text children only: strings become text nodes, never markup.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  return fetch(path, opts);
}

function setStatus(text, isError) {
  const s = $("status");
  s.textContent = text;
  s.className = isError ? "error" : "muted";
}

// -- start ------------------------------------------------------------------------------------
async function start() {
  $("key").addEventListener("submit", (e) => { e.preventDefault(); useKey(); });
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("clear").addEventListener("click", () => { state.history = []; clear($("chat-log")); });
  await loadModels();
  refresh();
  setInterval(refresh, 2000);
}

async function useKey() {
  state.key = $("key-input").value.trim();
  sessionStorage.setItem("kvserve-key", state.key);
  await loadModels();
  refresh();
}

// What this key may see, asked of /ui/session (which answers any key: no failing request).
async function loadSession() {
  let r;
  try { r = await api("/ui/session"); } catch (err) { setStatus("server unreachable", true); return false; }
  state.session = await r.json();
  state.admin = state.session.admin;
  $("role").textContent = state.admin ? "admin view" : "";
  if (state.session.key_required && !state.session.key_accepted) {
    $("key-form").hidden = false;
    $("key-error").textContent = state.key ? "that key was refused" : "";
    setStatus("needs an API key", true);
    return false;
  }
  $("key-form").hidden = true;
  return true;
}

async function loadModels() {
  if (!(await loadSession())) return;
  const r = await api("/v1/models");
  if (r.status === 401) {  // behind a gateway without keys of its own: the replica judged
    $("key-form").hidden = false;
    $("key-error").textContent = state.key ? "that key was refused" : "";
    setStatus("needs an API key", true);
    return;
  }
  const body = await r.json();
  const select = $("model");
  clear(select);
  for (const m of body.data || []) select.append(el("option", { value: m.id }, m.id));
  state.ready = true;
  setStatus("ready");
}

// -- chat -------------------------------------------------------------------------------------
function bubble(role, text) {
  const body = el("span", { class: "text" }, text);
  const node = el("div", { class: "msg " + role }, el("span", { class: "who" }, role), body);
  $("chat-log").append(node);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return { node, body };
}

function numberOf(id) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.busy) return;
  state.busy = true;
  $("send").disabled = true;
  $("prompt").value = "";
  state.history.push({ role: "user", content: text });
  bubble("user", text);
  const answer = bubble("assistant", "");
  const body = {
    model: $("model").value || undefined, messages: state.history, stream: true,
    stream_options: { include_usage: true }, kv_cache_report: true,
    temperature: numberOf("temperature"), top_p: numberOf("top-p"),
    max_tokens: numberOf("max-tokens"),
  };
  const salt = $("cache-salt").value.trim();
  if (salt) body.cache_salt = salt;
  let reply = "";
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + r.status));
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          for (const choice of chunk.choices || []) {
            const delta = choice.delta || {};
            if (delta.content) { reply += delta.content; answer.body.textContent = reply; }
            for (const call of delta.tool_calls || []) {
              const fn = call.function || {};
              reply += (fn.name ? "\n[tool call " + fn.name + "] " : "") + (fn.arguments || "");
              answer.body.textContent = reply;
            }
          }
          if (chunk.usage) {
            const cached = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
            answer.node.append(el("span", { class: "meta" },
              chunk.usage.prompt_tokens + " prompt tokens (" + cached + " cached), " +
              chunk.usage.completion_tokens + " generated"));
          }
          if (chunk.kv_cache_report) showReport(chunk.kv_cache_report);
        }
      }
      $("chat-log").scrollTop = $("chat-log").scrollHeight;
    }
    state.history.push({ role: "assistant", content: reply });
    setStatus("ready");
  } catch (err) {
    answer.node.append(el("span", { class: "meta error" }, String(err.message || err)));
    state.history.pop();
    setStatus("request failed", true);
  } finally {
    state.busy = false;
    $("send").disabled = false;
    refresh(true);
  }
}

function showReport(report) {
  $("last-prompt").textContent = report.prompt_tokens;
  $("last-cached").textContent = report.cached_tokens;
  const sources = Object.entries(report.cached_tokens_by_source || {})
    .filter(([, n]) => n > 0).map(([s, n]) => s + " " + n);
  $("last-sources").textContent = sources.length ? sources.join(", ") : "none";
  const miss = report.first_miss;
  let reason = "none";
  if (miss) {
    reason = miss.reason + " at token " + miss.position;
    if (miss.cached_text !== undefined) reason += " (cached: \u201c" + miss.cached_text + "\u201d)";
  }
  $("last-reason").textContent = reason;
}

// -- the cache panel --------------------------------------------------------------------------
function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)$/);
    if (!m) continue;
    const labels = {};
    for (const pair of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    out.push({ name: m[1], labels, value: parseFloat(m[4]) });
  }
  return out;
}

function sum(metrics, name, filter) {
  return metrics.filter((m) => m.name === name && (!filter || filter(m.labels)))
    .reduce((a, m) => a + m.value, 0);
}

// The tree walks the server's whole prefix index on its engine thread: every 5th refresh
// (10 s), and after each chat, rather than every 2 s as the metrics.
async function refresh(afterChat) {
  if (!state.ready) return;
  const gateway = state.session && state.session.gateway;
  state.refreshes = (state.refreshes || 0) + 1;
  const tree = state.admin && (afterChat === true || state.refreshes % 5 === 1);
  await Promise.all([refreshMetrics(), gateway ? refreshReplicas() : refreshPins(),
                     tree ? refreshTree() : null]);
}

async function refreshMetrics() {
  let r;
  try { r = await api("/metrics"); } catch (err) { return; }
  if (!r.ok) return;
  const metrics = parseMetrics(await r.text());
  const usage = metrics.find((m) => m.name === "kvserve:kv_cache_usage_perc");
  if (usage) {
    state.usage.push(usage.value);
    if (state.usage.length > 150) state.usage.shift();
    $("pool-now").textContent = (100 * usage.value).toFixed(1) + "% of the KV pool in use";
    drawUsage();
  }
  const queries = sum(metrics, "kvserve:prefix_cache_queries_total");
  const hits = sum(metrics, "kvserve:prefix_cache_hits_total");
  if (queries > 0) {
    $("hit-rate").textContent = (100 * hits / queries).toFixed(1) + "% of " + queries +
      " prompt tokens served from the cache";
  }
  const box = $("hit-sources");
  clear(box);
  const bySource = metrics.filter((m) => m.name === "kvserve:prefix_cache_hits_by_source_total");
  for (const m of bySource) {
    const share = queries > 0 ? m.value / queries : 0;
    box.append(el("div", {}, (m.labels.source || "?") + ": " + m.value + " tokens"));
    const bar = el("div", { class: "bar" });
    bar.style.width = Math.max(1, Math.round(100 * share)) + "%";
    box.append(bar);
  }
  const tiers = metrics.filter((m) => m.name === "kvserve:kv_tier_usage_bytes");
  for (const t of tiers) {
    box.append(el("div", { class: "muted" }, (t.labels.tier || "tier") + " tier holds " +
      (t.value / 1048576).toFixed(1) + " MiB"));
  }
  const tenants = metrics.filter((m) => m.name === "kvserve:kv_tenant_idle_cached_blocks");
  const list = $("tenants");
  clear(list);
  $("tenants-panel").hidden = !(state.admin && tenants.length);
  for (const t of tenants) list.append(el("li", {}, t.labels.tenant + ": " + t.value + " blocks"));
}

function drawUsage() {
  const canvas = $("pool-usage");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#d9dde5";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
  if (state.usage.length < 2) return;
  ctx.strokeStyle = "#2f6fde";
  ctx.lineWidth = 2;
  ctx.beginPath();
  state.usage.forEach((u, i) => {
    const x = (i / (state.usage.length - 1)) * (w - 4) + 2;
    const y = h - 2 - u * (h - 4);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function refreshPins() {
  let r;
  try { r = await api("/v1/cache/pins"); } catch (err) { return; }
  if (!r.ok) return;
  const body = await r.json();
  const list = $("pins");
  clear(list);
  if (!body.data.length) list.append(el("li", { class: "muted" }, "none"));
  for (const p of body.data) {
    const owner = p.owner ? " (owner " + p.owner.slice(0, 8) + ")" : "";
    list.append(el("li", {}, p.id + ": " + p.num_tokens + " tokens in " + p.num_blocks +
      " blocks" + owner));
  }
  list.append(el("li", { class: "muted" }, body.num_pinned_blocks + " of " + body.limit_blocks +
    " blocks pinnable are pinned"));
}

async function refreshTree() {
  let r;
  try { r = await api("/v1/cache/tree?limit=40"); } catch (err) { return; }
  $("tree-panel").hidden = !r.ok;
  if (!r.ok) return;
  const tree = await r.json();
  const box = $("tree");
  clear(box);
  if (!tree.cached_blocks) { box.append(el("div", { class: "muted" }, "empty")); return; }
  const top = el("ul");
  for (const ns of tree.namespaces) {
    const item = el("li", {}, el("strong", {}, ns.namespace + " namespace"),
      " " + ns.cached_blocks + " blocks");
    const sub = el("ul");
    for (const b of ns.branches) sub.append(segment(b, tree.cached_blocks));
    item.append(sub);
    top.append(item);
  }
  box.append(top);
}

function segment(seg, total) {
  const item = el("li", {},
    el("div", {}, seg.tokens + " tokens from token " + seg.start_tokens + ", " +
      seg.cached_blocks + " blocks below, " + seg.hits + " hits, idle " + seg.idle_seconds + " s" +
      (seg.retention ? ", retained at priority " + seg.retention.priority +
        (seg.retention.seconds_left !== null ? " for " + seg.retention.seconds_left + " s" : "") : "") +
      (seg.tenant ? ", tenant " + seg.tenant : "")),
    el("div", { class: "seg-text" }, seg.text + (seg.tokens > 16 ? "…" : "")));
  const bar = el("div", { class: "bar" });
  bar.style.width = Math.max(1, Math.round(100 * seg.cached_blocks / total)) + "%";
  item.append(bar);
  if (seg.children.length) {
    const sub = el("ul");
    for (const c of seg.children) sub.append(segment(c, total));
    item.append(sub);
  }
  return item;
}

async function refreshReplicas() {
  let r;
  try { r = await api("/replicas"); } catch (err) { return; }
  if (!r.ok || !(r.headers.get("content-type") || "").includes("json")) return;
  const body = await r.json();
  if (!body.replicas) return;
  $("replicas-panel").hidden = false;
  const tbody = $("replicas").querySelector("tbody");
  clear(tbody);
  for (const rep of body.replicas) {
    tbody.append(el("tr", {}, el("td", {}, rep.name + " " + rep.url), el("td", {}, rep.role),
      el("td", {}, rep.healthy ? "yes" : "no"), el("td", {}, rep.in_flight),
      el("td", {}, rep.known_blocks)));
  }
}

document.addEventListener("DOMContentLoaded", start);
