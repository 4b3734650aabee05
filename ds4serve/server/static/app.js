// The ds4serve page: a chat over the server's own /v1/chat/completions (streamed), and the engine's figures
// polled from /v1/engine/stats. Plain JavaScript, no libraries; everything comes from this server.
"use strict";

const $ = (id) => document.getElementById(id);
const PHASES = ["hc_pre", "attention", "moe_ffn", "hc_post", "output_projection", "other"];
const POLL_MS = 1000;
const RATE_POINTS = 60;
const KEY_STORE = "ds4serve.apiKey";

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  model: null, // the served model's id, from /v1/models
  messages: [], // the conversation: {role, content, reasoning?, tool_calls?}
  controller: null, // the AbortController of the generation running, or null
  poller: null,
  rates: [], // generated tokens/s, one per poll
};

// ---- calls to the server ---------------------------------------------------------------------------------

class KeyNeeded extends Error {}

// fetch() with the API key when one is set; a 401 asks for the key and throws KeyNeeded.
async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    askForKey();
    throw new KeyNeeded("the server needs an API key");
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// The data fields of a server-sent event stream, one string per event (comments and other fields skipped).
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

// ---- notices and the API key ------------------------------------------------------------------------------

function notify(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function askForKey() {
  notify("This server needs an API key: enter it above, then press Use key.");
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("api-key").value = "";
  $("api-key").placeholder = state.key ? "API key set" : "API key (if the server has one)";
  notify("");
  loadModel();
  if (!$("engine-view").hidden) showView("engine");
}

async function loadModel() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) return notify(await errorText(response));
    const body = await response.json();
    state.model = body.data[0].id;
    $("model-name").textContent = state.model;
  } catch (err) {
    if (!(err instanceof KeyNeeded)) notify(`cannot reach the server: ${err.message}`);
  }
}

// ---- chat ---------------------------------------------------------------------------------------------------

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

// The view of one assistant message: a folded reasoning part, the answer, tool calls, a status line.
function assistantView() {
  const item = element("li", "message assistant");
  const reasoning = element("details", "reasoning");
  reasoning.hidden = true;
  reasoning.append(element("summary", "", "Reasoning"), element("div", "reasoning-text"));
  const view = {
    item,
    reasoning,
    reasoningText: reasoning.lastChild,
    answer: element("div", "answer"),
    calls: element("div", "tool-calls"),
    status: element("div", "status muted", "…"),
  };
  item.append(reasoning, view.answer, view.calls, view.status);
  $("messages").append(item);
  return view;
}

function showToolCalls(view, calls) {
  view.calls.replaceChildren(
    ...calls.map((call) => {
      const box = element("div", "tool-call");
      box.append(element("span", "tool-name", call.function.name), element("code", "", call.function.arguments));
      return box;
    }),
  );
}

function showUser(text) {
  const item = element("li", "message user");
  item.append(element("div", "answer", text));
  $("messages").append(item);
}

function scrollDown() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

// The number in the input field `id`, or undefined when the field is empty.
function numberIn(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

const NOT_RUN = "Not run: this chat page shows tool calls but runs no tools.";

function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of state.messages) {
    const sent = { role: m.role, content: m.content };
    if (m.tool_calls && m.tool_calls.length) sent.tool_calls = m.tool_calls;
    messages.push(sent);
    // The page shows a call and runs nothing; the API wants each call answered by a tool message right after it
    // (a call without one is a 400), so the history says that the call was not run.
    for (const call of sent.tool_calls || []) messages.push({ role: "tool", tool_call_id: call.id, content: NOT_RUN });
  }
  const body = {
    model: state.model || undefined, // a field left undefined is not sent: the server's default applies
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberIn("temperature"),
    top_p: numberIn("top-p"),
    max_tokens: numberIn("max-tokens"),
    seed: numberIn("seed"),
    thinking: { type: $("thinking").checked ? "enabled" : "disabled" },
  };
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !state.messages.length;
}

// Generate the assistant's reply to the conversation, streaming it into a new message view.
async function generate() {
  let body;
  try {
    body = requestBody();
  } catch (err) {
    return notify(`Tools: not a JSON list (${err.message})`);
  }
  notify("");
  const conversation = state.messages; // Clear starts a new one: this reply must not land there
  const view = assistantView();
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  state.controller = new AbortController();
  setBusy(true);
  let outcome = "ended"; // ended, finished, stopped or error: the view's data-outcome
  let detail = "";
  let usage = "";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = ` · ${chunk.usage.prompt_tokens} prompt, ${chunk.usage.completion_tokens} generated tokens`;
      for (const choice of chunk.choices || []) {
        applyDelta(view, reply, choice.delta || {});
        if (choice.finish_reason) [outcome, detail] = ["finished", choice.finish_reason];
      }
      scrollDown();
    }
  } catch (err) {
    if (err.name === "AbortError") outcome = "stopped";
    else [outcome, detail] = ["error", err instanceof KeyNeeded ? "the server needs an API key" : err.message];
  }
  view.status.textContent = (detail ? `${outcome}: ${detail}` : outcome) + usage;
  view.item.dataset.outcome = outcome;
  if (reply.content || reply.tool_calls.length) conversation.push(reply);
  state.controller = null;
  setBusy(false);
}

function applyDelta(view, reply, delta) {
  if (delta.reasoning_content) {
    reply.reasoning += delta.reasoning_content;
    view.reasoning.hidden = false;
    view.reasoningText.textContent = reply.reasoning;
  }
  if (delta.content) {
    reply.content += delta.content;
    view.answer.textContent = reply.content;
  }
  for (const part of delta.tool_calls || []) {
    const call = (reply.tool_calls[part.index] ||= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (part.id) call.id = part.id;
    if (part.function && part.function.name) call.function.name = part.function.name;
    if (part.function && part.function.arguments) call.function.arguments += part.function.arguments;
    showToolCalls(view, reply.tool_calls);
  }
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  showUser(text);
  generate();
}

// Drop the last reply (and its view, which may hold no answer: reasoning only, an error), then generate a new
// one for the same conversation.
function regenerate() {
  if (state.controller || !state.messages.length) return;
  if (state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
  const last = $("messages").lastElementChild;
  if (last && last.classList.contains("assistant")) last.remove();
  generate();
}

function clearChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren();
  setBusy(false);
}

// ---- engine view ----------------------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

const num = (x, digits = 1) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const ms = (x) => (x === null || x === undefined ? "–" : x < 10 ? `${x.toFixed(2)} ms` : `${x.toFixed(0)} ms`);

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) (n /= 1024), i++;
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function setText(id, text) {
  $(id).textContent = text;
}

function showStats(s) {
  setText("stat-running", s.requests.running);
  setText("stat-waiting", s.requests.waiting);
  setText("stat-max-batch", s.requests.max_batch);
  setText("stat-finished", s.requests.finished);
  setText("stat-cancelled", s.requests.cancelled);
  setText("stat-batch", num(s.decode_steps.mean_batch, 2));
  setText("stat-batch-last", s.decode_steps.last_batch);
  setText("stat-batch-max", s.decode_steps.max_batch);
  setText("stat-steps", num(s.decode_steps.per_s));
  setText("stat-tok-out", num(s.tokens_per_s.generated));
  setText("stat-tok-in", num(s.tokens_per_s.prompt));
  setText("stat-total-out", s.tokens.generated);
  setText("stat-total-in", s.tokens.prompt);
  setText("stat-ttft-p50", ms(s.ttft_ms.p50));
  setText("stat-ttft-p99", ms(s.ttft_ms.p99));
  setText("stat-ttft-n", s.ttft_ms.count);
  setText("stat-itl-p50", ms(s.inter_token_ms.p50));
  setText("stat-itl-p99", ms(s.inter_token_ms.p99));
  setText("stat-itl-n", s.inter_token_ms.count);
  for (const el of document.querySelectorAll(".latency-window")) el.textContent = `${s.window_s.latency} s`;
  for (const el of document.querySelectorAll(".rate-window")) el.textContent = `${RATE_POINTS} s`;
  const cache = s.prefix_cache;
  setText("stat-cache-hits", cache ? cache.hits : "–");
  setText("stat-cache-misses", cache ? cache.misses : "–");
  setText(
    "stat-cache-detail",
    cache ? `${cache.cached_tokens} prompt tokens restored; ${bytes(cache.bytes)} of ${bytes(cache.max_bytes)} held` : "no prefix cache",
  );
  setText("stat-rss", bytes(s.memory.rss_bytes));
  setText(
    "stat-cuda",
    s.memory.cuda.length
      ? s.memory.cuda.map((d) => `${d.device}: ${bytes(d.allocated_bytes)} used, ${bytes(d.reserved_bytes)} reserved of ${bytes(d.total_bytes)}`).join("; ")
      : "no CUDA device in use",
  );
  state.rates.push(s.tokens_per_s.generated);
  if (state.rates.length > RATE_POINTS) state.rates.shift();
  drawRates($("rate-chart"), state.rates);
  drawProfile(s.profiler);
}

function drawRates(chart, rates) {
  const [w, h, pad] = [1000, 140, 22];
  const top = Math.max(1, ...rates);
  const x = (i) => pad + (i * (w - 2 * pad)) / (RATE_POINTS - 1);
  const y = (v) => h - pad - (v / top) * (h - 2 * pad);
  const points = rates.map((v, i) => `${x(i + RATE_POINTS - rates.length).toFixed(1)},${y(v).toFixed(1)}`);
  chart.replaceChildren(
    svg("line", { x1: pad, y1: h - pad, x2: w - pad, y2: h - pad, class: "axis" }),
    svg("text", { x: 2, y: pad - 6, class: "label" }, `${top.toFixed(1)} tok/s`),
    svg("polyline", { points: points.join(" "), class: "rate" }),
  );
}

// A step's milliseconds per chart phase; "other" is the step's time outside the top-level phases.
function stepParts(step) {
  const parts = {};
  let inside = 0;
  for (const p of PHASES.slice(0, -1)) {
    parts[p] = step.phases[p] || 0;
    inside += parts[p];
  }
  parts.other = Math.max(0, step.step_ms - inside);
  return parts;
}

function drawProfile(profile) {
  const on = profile.enabled && profile.recent.length > 0;
  $("profile-off").hidden = profile.enabled;
  $("profile-waiting").hidden = !profile.enabled || on;
  $("profile-charts").hidden = !on;
  if (!on) return;
  $("phase-legend").replaceChildren(...PHASES.map((p) => element("span", `key phase-${p}`, p)));
  drawModes($("phase-chart"), profile.modes);
  drawSteps($("steps-chart"), profile.recent);
}

// One horizontal stacked bar per mode: the mean milliseconds of each phase of its recent steps.
function drawModes(chart, modes) {
  const entries = Object.entries(modes);
  const [w, left, bar] = [1000, 110, 26];
  const top = Math.max(1e-6, ...entries.map(([, m]) => m.step_ms));
  chart.setAttribute("viewBox", `0 0 ${w} ${entries.length * (bar + 14) + 10}`);
  const shapes = [];
  entries.forEach(([mode, m], row) => {
    const y = 6 + row * (bar + 14);
    shapes.push(svg("text", { x: 0, y: y + bar / 2 + 4, class: "label" }, `${mode} (${m.steps})`));
    let x = left;
    const parts = stepParts(m);
    for (const p of PHASES) {
      const width = (parts[p] / top) * (w - left - 90);
      const rect = svg("rect", { x, y, width: Math.max(0, width), height: bar, class: `phase-${p}` });
      rect.append(svg("title", {}, `${mode} ${p}: ${ms(parts[p])}`));
      shapes.push(rect);
      x += width;
    }
    shapes.push(svg("text", { x: x + 6, y: y + bar / 2 + 4, class: "label" }, ms(m.step_ms)));
  });
  chart.replaceChildren(...shapes);
}

// One stacked column per recent step, oldest on the left, its height the step's milliseconds.
function drawSteps(chart, steps) {
  const [w, h, pad] = [1000, 180, 20];
  const top = Math.max(1e-6, ...steps.map((s) => s.step_ms));
  const slot = (w - 2 * pad) / Math.max(steps.length, 1);
  const shapes = [svg("text", { x: 2, y: 12, class: "label" }, `${ms(top)} per step at most`)];
  steps.forEach((step, i) => {
    let y = h - pad;
    const parts = stepParts(step);
    for (const p of PHASES) {
      const height = (parts[p] / top) * (h - 2 * pad);
      y -= height;
      const rect = svg("rect", { x: pad + i * slot, y, width: Math.max(1, slot - 2), height, class: `phase-${p}` });
      rect.append(svg("title", {}, `${step.mode}, ${step.tokens} token(s): ${p} ${ms(parts[p])}`));
      shapes.push(rect);
    }
  });
  chart.replaceChildren(...shapes);
}

async function poll() {
  try {
    const response = await api("/v1/engine/stats");
    if (!response.ok) return notify(await errorText(response));
    showStats(await response.json());
    $("engine-view").dataset.polls = Number($("engine-view").dataset.polls || 0) + 1;
  } catch (err) {
    if (err instanceof KeyNeeded) stopPolling(); // until a key is given (useKey starts again)
    else notify(`cannot reach the server: ${err.message}`);
  }
}

function stopPolling() {
  clearInterval(state.poller);
  state.poller = null;
}

// ---- tabs and wiring ---------------------------------------------------------------------------------------

function showView(name) {
  const engine = name === "engine";
  $("chat-view").hidden = engine;
  $("engine-view").hidden = !engine;
  $("tab-chat").setAttribute("aria-selected", String(!engine));
  $("tab-engine").setAttribute("aria-selected", String(engine));
  stopPolling();
  if (engine) {
    poll();
    state.poller = setInterval(poll, POLL_MS);
  }
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
}

function start() {
  $("tab-chat").addEventListener("click", () => showView("chat"));
  $("tab-engine").addEventListener("click", () => showView("engine"));
  $("key-form").addEventListener("submit", useKey);
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", clearChat);
  if (state.key) $("api-key").placeholder = "API key set";
  showView(location.hash === "#engine" ? "engine" : "chat");
  loadModel();
}

start();
