// servelm's console: a chat over /v1/chat/completions (streamed, stoppable) and a dashboard
// polled from /v1/stats. Only this server is ever asked for anything (the page's CSP allows
// nothing else), and model output reaches the page as text nodes only (markdown.js).

import { renderMarkdown } from "./markdown.js";
import { drawRoofline, phasePoint, si } from "./roofline.js";

const POLL_MS = 500;          // the dashboard's refresh: twice a second
const SPARK_POINTS = 120;     // a minute of generation rates at POLL_MS
const KEY_STORE = "servelm.apiKey";

const $ = (id) => document.getElementById(id);
const keyRequired = document.querySelector('meta[name="servelm-api-key"]')?.content === "required";
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let controller = null;        // the AbortController of the answer streaming now
const history = [];           // the conversation's finished turns, sent with each message
const genRates = [];

class AuthError extends Error {}

function setStatus(text, kind = "") {
  const s = $("status");
  s.textContent = text;
  s.className = `status ${kind}`;
}

async function api(path, init = {}) {
  const headers = { ...(init.headers || {}) };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  if (init.body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, { ...init, headers });
  if (res.status === 401) {
    askForKey(apiKey ? "the server refused this key" : "");
    throw new AuthError("API key needed");
  }
  return res;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return body.error?.message || `HTTP ${res.status}`;
  } catch {
    return `HTTP ${res.status}`;
  }
}

// ---- the API key ----------------------------------------------------------------------------

function askForKey(message) {
  const panel = $("key-panel");
  $("key-error").textContent = message;
  setStatus("API key needed", "warn");
  if (panel.hidden) {
    panel.hidden = false;
    $("api-key").focus();
  }
}

function saveKey() {
  apiKey = $("api-key").value.trim();
  if (!apiKey) return;
  sessionStorage.setItem(KEY_STORE, apiKey);
  $("key-panel").hidden = true;
  $("key-error").textContent = "";
  connect();
}

// ---- models -----------------------------------------------------------------------------------

async function connect() {
  if (keyRequired && !apiKey) return askForKey("");
  try {
    const res = await api("/v1/models");
    if (!res.ok) throw new Error(await errorText(res));
    const { data } = await res.json();
    // An option is the model's whole name; its context length is shown beside the picker.
    $("model").replaceChildren(...data.map((m) => {
      const o = document.createElement("option");
      o.value = o.textContent = m.id;
      if (m.max_model_len) o.dataset.len = `${num(m.max_model_len)} tokens`;
      return o;
    }));
    showModelLength();
    setStatus(`connected · ${data.length} model${data.length === 1 ? "" : "s"}`, "ok");
  } catch (e) {
    if (!(e instanceof AuthError)) setStatus(`cannot list models: ${e.message}`, "bad");
  }
}

function showModelLength() {
  const m = $("model");
  $("model-len").textContent = m.options[m.selectedIndex]?.dataset.len || "";
}

// ---- chat -------------------------------------------------------------------------------------

/** The `data:` payloads of a server-sent event stream. */
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    for (let i; (i = buf.indexOf("\n\n")) >= 0;) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

function addMessage(role, text) {
  $("log").querySelector(".empty")?.remove();
  const msg = document.createElement("article");
  msg.className = `msg ${role}`;
  const who = msg.appendChild(document.createElement("div"));
  who.className = "who";
  who.textContent = role === "user" ? "you" : $("model").value || "model";
  const body = msg.appendChild(document.createElement("div"));
  body.className = "body";
  if (text !== undefined) body.textContent = text;
  const meta = msg.appendChild(document.createElement("div"));
  meta.className = "meta";
  $("log").append(msg);
  msg.scrollIntoView({ block: "end" });
  return { msg, body, meta };
}

const ms = (s) => (s === null || s === undefined ? "–"
  : s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms` : `${s.toFixed(2)} s`);

/** One answer's timings and token counts: the server's own (in the final chunk) when it
 * finished, else what this page measured while it streamed (marked ≈). */
function answerMeta(a) {
  const parts = [];
  if (a.metrics) {
    parts.push(`TTFT ${ms(a.metrics.ttft_s)}`, `TPOT ${ms(a.metrics.tpot_s)}`);
  } else if (a.firstAt !== null) {
    const tpot = a.chunks > 1 ? (a.lastAt - a.firstAt) / 1000 / (a.chunks - 1) : null;
    parts.push(`TTFT ≈${ms((a.firstAt - a.sentAt) / 1000)}`, `TPOT ≈${ms(tpot)}`);
  }
  if (a.usage) {
    const cached = a.usage.prompt_tokens_details?.cached_tokens || 0;
    parts.push(`${a.usage.prompt_tokens} prompt${cached ? ` (${cached} cached)` : ""} + ` +
      `${a.usage.completion_tokens} generated tokens`);
  } else if (a.chunks) {
    parts.push(`≈${a.chunks} generated tokens`);
  }
  if (a.finish) parts.push(a.finish === "length" ? "hit max tokens" : a.finish);
  return parts.join(" · ");
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  addMessage("user", text);
  const view = addMessage("assistant");
  // The latest answer carries the test contract's name; older ones give it up.
  document.querySelectorAll('[data-testid="chat-output"]').forEach((e) => e.removeAttribute("data-testid"));
  view.body.dataset.testid = "chat-output";
  view.msg.classList.add("streaming");

  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history,
    { role: "user", content: text }];
  const a = { content: "", chunks: 0, sentAt: performance.now(), firstAt: null, lastAt: null,
    usage: null, metrics: null, finish: null, error: null };
  let painting = false;
  const paint = () => {
    view.body.replaceChildren(renderMarkdown(a.content));
    view.meta.textContent = answerMeta(a);
    view.msg.scrollIntoView({ block: "end" });
  };
  const schedulePaint = () => {  // at most once a frame, however fast tokens come
    if (painting) return;
    painting = true;
    requestAnimationFrame(() => { painting = false; paint(); });
  };

  controller = new AbortController();
  setStreaming(true);
  try {
    const body = { model: $("model").value, messages, stream: true,
      stream_options: { include_usage: true } };
    const temperature = parseFloat($("temperature").value);
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (isFinite(temperature)) body.temperature = temperature;
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const res = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      signal: controller.signal });
    if (!res.ok) {
      a.error = await errorText(res);
    } else {
      for await (const data of sseData(res.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          a.error = chunk.error.message;
          continue;
        }
        if (chunk.usage) a.usage = chunk.usage;
        if (chunk.metrics) a.metrics = chunk.metrics;
        for (const c of chunk.choices || []) {
          if (c.delta?.content) {
            a.content += c.delta.content;
            a.lastAt = performance.now();
            a.firstAt ??= a.lastAt;
            a.chunks++;
            schedulePaint();
          }
          if (c.finish_reason) a.finish = c.finish_reason;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") a.finish = "stopped";
    else a.error = e instanceof AuthError ? "an API key is needed" : String(e.message || e);
  } finally {
    controller = null;
    setStreaming(false);
    view.msg.classList.remove("streaming");
    paint();
    if (a.error) {
      const err = view.meta.appendChild(document.createElement("span"));
      err.className = "error-text";
      err.textContent = ` error: ${a.error}`;
    }
    view.msg.dataset.finish = a.error ? "error" : a.finish || "done";
    if (a.content) history.push({ role: "user", content: text }, { role: "assistant", content: a.content });
  }
}

function clearChat() {
  controller?.abort();
  history.length = 0;
  const p = document.createElement("p");
  p.className = "empty";
  p.textContent = "New conversation.";
  $("log").replaceChildren(p);
}

// ---- the dashboard ----------------------------------------------------------------------------

const num = (v, digits = 0) => (v === null || v === undefined ? "–"
  : Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits }));
const pct = (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`);

function set(id, text) {
  const e = $(id);
  if (e.textContent !== text) e.textContent = text;
}

function spark(svg, values) {
  const max = Math.max(1, ...values);
  const pts = values.map((v, i) => `${(i / (SPARK_POINTS - 1)) * 120},${23 - (v / max) * 22}`);
  let line = svg.firstChild;
  if (!line) {
    line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    svg.append(line);
  }
  line.setAttribute("points", pts.join(" "));
}

function showPhase(name, phase) {
  const p = phasePoint(phase);
  const row = document.querySelector(`tr.${name}`);
  row.classList.toggle("stale", !!p?.stale);
  set(`m-${name}-bandwidth`, p ? si(p.bandwidth, "B/s") : "–");
  set(`m-${name}-flops`, p ? si(p.flops, "FLOP/s") : "–");
  set(`m-${name}-intensity`, p ? `${si(p.intensity)} FLOP/B` : "–");
  set(`m-${name}-bound`, !p?.bound ? "–"
    : `${p.bound}-bound, ${pct(p.utilization)} of ${p.bound === "memory" ? "bandwidth" : "peak"}`);
}

// Behind a router (servelm serve --data-parallel-size / --disaggregate, servelm router) the
// report's counts are every replica's summed; this table shows each one.
function showReplicas(s) {
  const list = Array.isArray(s.backends) ? s.backends : null;
  $("replicas").hidden = !list;
  if (!list) return;
  const r = s.router || {}, pre = r.prefilled;
  set("m-router", `policy ${r.policy || "–"}` + (r.prefill_backends_up !== undefined
    && (pre?.remote || pre?.failed || r.prefill_backends_up)
    ? ` · prompts prefilled apart ${num(pre?.remote)}, by the answering replica `
      + `${num(pre?.local)}, failed ${num(pre?.failed)}` : ""));
  const rows = list.map((b) => {
    const st = b.stats || {}, kt = st.kv_transfer || {};
    const moved = kt.sent ? `${num(kt.sent.tokens)} tokens sent`
      : kt.received ? `${num(kt.received.tokens)} tokens received` : "–";
    const tr = document.createElement("tr");
    tr.classList.toggle("stale", !b.up);
    for (const text of [b.url, b.role || "–", b.up ? "up" : "down", num(b.routed),
      num(st.requests?.running), num(st.requests?.waiting), pct(st.kv_cache?.usage),
      pct(st.prefix_cache?.hit_rate), num(st.tokens?.generated_per_s, 1), moved]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
    return tr;
  });
  $("m-replicas").replaceChildren(...rows);
}

function update(s) {
  const r = s.requests, kv = s.kv_cache, pc = s.prefix_cache, t = s.tokens, lat = s.latency;
  set("m-running", num(r.running));
  set("m-waiting", num(r.waiting));
  set("m-preemptions", num(r.preemptions));
  set("m-aborted", num(r.aborted));

  set("m-kv-pct", pct(kv.usage));
  $("m-kv-bar").style.width = `${Math.min(100, kv.usage * 100)}%`;
  set("m-kv-usage", `${num(kv.blocks_used)} / ${num(kv.blocks_total)}`);
  set("m-kv-capacity", `${num(kv.capacity_tokens)} tokens`);
  set("m-kv-block", `${num(kv.block_size)} tokens`);

  set("m-hit-rate", pct(pc.hit_rate));
  set("m-hits", num(pc.hit_tokens));
  set("m-queried", num(pc.queried_tokens));

  set("m-gen-rate", num(t.generated_per_s, 1));
  set("m-prompt-rate", num(t.prompt_per_s, 1));
  set("m-generated", num(t.generated));
  genRates.push(t.generated_per_s || 0);
  if (genRates.length > SPARK_POINTS) genRates.shift();
  spark($("m-gen-spark"), genRates);

  set("m-lat-n", lat.requests ? `last ${num(lat.requests)} requests` : "no request finished yet");
  for (const k of ["ttft", "tpot"]) {
    for (const p of ["p50", "p90", "p99"]) set(`m-${k}-${p}`, ms(lat[`${k}_s`]?.[p]));
  }

  const roof = s.roofline, hw = roof.machine;
  set("m-machine", hw ? `${si(hw.bandwidth, "B/s")} · ${si(hw.flops, "FLOP/s")}`
    + (hw.int8_ops ? ` · int8 ${si(hw.int8_ops, "OP/s")}` : "") + ` · ${hw.source}`
    : "machine not measured");
  drawRoofline($("roofline"), roof);
  showPhase("decode", roof.decode);
  showPhase("prefill", roof.prefill);
  showReplicas(s);
  set("m-window", s.window_s ? `Rates and points over the last ${s.window_s.toFixed(1)} s; ` +
    "a hollow point (a grey row) is the average since start: no such step ran lately."
    : "Rates appear from the second refresh on.");
}

let reachable = true;

async function poll() {
  try {
    if ((!keyRequired || apiKey) && $("key-panel").hidden) {  // not while a key is asked for
      const res = await api("/v1/stats");
      if (res.ok) update(await res.json());
      if (!reachable) connect();  // back after an outage: list the models again
      reachable = true;
    }
  } catch (e) {
    if (!(e instanceof AuthError)) {
      reachable = false;
      setStatus("server unreachable", "bad");
    }
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ---- wiring -----------------------------------------------------------------------------------

$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", clearChat);
$("model").addEventListener("change", showModelLength);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("api-key-save").addEventListener("click", saveKey);
$("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") saveKey(); });
connect();
poll();
