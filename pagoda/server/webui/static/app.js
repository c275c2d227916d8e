// pagoda's web page: a streaming chat over /v1/chat/completions and a live panel fed by
// GET /stats. Plain JavaScript, no build step, no third-party code.
//
// With an API key on the server, every API call answers 401 until the page has the key: the
// page then asks for it (a dialog), keeps it in sessionStorage (this tab only) and sends it as
// `Authorization: Bearer`. `?refresh=MS` sets the panel's refresh interval (default 1000).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(window.location.search);
  const REFRESH_MS = Math.max(100, Number(params.get("refresh")) || 1000);
  const KEY_STORE = "pagoda.apiKey";
  const SPARK_POINTS = 120;

  const state = {
    apiKey: sessionStorage.getItem(KEY_STORE) || "",
    model: null,
    history: [],            // the conversation: {role, content}
    controller: null,       // AbortController of the reply being streamed
    genRates: [],           // generation tok/s, one per refresh, for the sparkline
    keyPromptOpen: false,
    keyDeclined: false,     // the dialog was cancelled: ask again only from the key button
  };

  class AuthError extends Error {}

  // ---- API ------------------------------------------------------------------------------
  async function api(path, options = {}) {
    const headers = {};
    if (options.body !== undefined) headers["Content-Type"] = "application/json";
    const sentKey = state.apiKey;
    if (sentKey) headers["Authorization"] = "Bearer " + sentKey;
    const response = await fetch(path, { ...options, headers });
    if (response.status === 401) {
      // A request sent before the key changed (e.g. a panel refresh in flight while the
      // dialog was answered) says nothing about the new key: ask again only if it used it.
      if (sentKey === state.apiKey) {
        askForKey(sentKey ? "The server refused this key. Enter another:" : null);
      }
      throw new AuthError("an API key is needed");
    }
    return response;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (_) {
      return `HTTP ${response.status}`;
    }
  }

  // Yields the data of each server-sent event of a fetch body, as text.
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (data) yield data;
      }
    }
  }

  // ---- connection and key -----------------------------------------------------------------
  function setStatus(text, kind) {
    $("status").textContent = text;
    $("status").dataset.state = kind;
  }

  function askForKey(message, force = false) {
    if (state.keyPromptOpen || (state.keyDeclined && !force)) return;
    state.keyPromptOpen = true;
    $("key-message").textContent = message || "This server needs an API key.";
    $("key-input").value = "";
    setStatus("needs an API key", "error");
    $("key-dialog").showModal();
  }

  function onKeyDialogClose() {
    state.keyPromptOpen = false;
    state.keyDeclined = $("key-dialog").returnValue !== "ok";
    if (state.keyDeclined) return;
    state.apiKey = $("key-input").value.trim();
    sessionStorage.setItem(KEY_STORE, state.apiKey);
    connect();
  }

  async function connect() {
    try {
      const response = await api("/v1/models");
      if (!response.ok) throw new Error(await errorText(response));
      const models = await response.json();
      state.model = models.data[0].id;
      $("model").textContent = state.model;
      setStatus("connected", "ok");
    } catch (e) {
      if (!(e instanceof AuthError)) setStatus("cannot reach the server", "error");
    }
  }

  // ---- live panel -------------------------------------------------------------------------
  const fmt = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
  const ms = (x) => (x === null || x === undefined ? "–" : x < 100 ? x.toFixed(1) : x.toFixed(0));

  function showPercentiles(name, values) {
    for (const p of ["p50", "p90", "p99"]) $(`stat-${name}-${p}`).textContent = ms(values && values[p]);
  }

  function renderStats(s) {
    $("stat-running").textContent = fmt(s.num_requests_running);
    $("stat-waiting").textContent = fmt(s.num_requests_waiting);
    $("stat-gen-tps").textContent = fmt(s.generation_tokens_per_s, 1);
    $("stat-prompt-tps").textContent = fmt(s.prompt_tokens_per_s, 1);
    const kv = 100 * s.kv_cache_usage;
    $("stat-kv").textContent = `${kv.toFixed(1)}%`;
    $("kv-bar").style.width = `${Math.min(100, kv)}%`;
    showPercentiles("ttft", s.ttft_ms);
    showPercentiles("itl", s.itl_ms);
    $("stat-prefix").textContent =
      s.prefix_cache_hit_rate === null ? "–" : `${(100 * s.prefix_cache_hit_rate).toFixed(1)}%`;
    $("stat-finished").textContent = fmt(s.num_finished_requests);
    $("panel-note").textContent =
      `tok/s over the last ${fmt(s.rate_window_s)} s; percentiles, hit rate and finished ` +
      `requests over the last ${fmt(s.window_s)} s; refreshed every ${REFRESH_MS / 1000} s.`;
    if (!state.model && s.model) $("model").textContent = s.model;
    state.genRates.push(s.generation_tokens_per_s);
    if (state.genRates.length > SPARK_POINTS) state.genRates.shift();
    drawSparkline();
  }

  function drawSparkline() {
    const canvas = $("spark");
    const ctx = canvas.getContext("2d");
    const w = canvas.width;
    const h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    const values = state.genRates;
    const top = Math.max(1, ...values);
    ctx.strokeStyle = "#b3432b";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    values.forEach((v, i) => {
      const x = (i / (SPARK_POINTS - 1)) * w;
      const y = h - 2 - (v / top) * (h - 14);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = "#6a6f76";
    ctx.font = "10px sans-serif";
    ctx.fillText(`generation tok/s (max ${top.toFixed(0)})`, 2, 10);
  }

  async function refreshStats() {
    try {
      const response = await api("/stats");
      if (response.ok) {
        renderStats(await response.json());
        $("panel-age").textContent = new Date().toLocaleTimeString();
        if (state.model) setStatus("connected", "ok");
      } else {
        $("panel-note").textContent = await errorText(response);
      }
    } catch (e) {
      if (!(e instanceof AuthError)) setStatus("cannot reach the server", "error");
    } finally {
      window.setTimeout(refreshStats, REFRESH_MS);
    }
  }

  // ---- chat ------------------------------------------------------------------------------
  function addMessage(role, text) {
    $("empty").hidden = true;
    const node = document.createElement("div");
    node.className = `message ${role}`;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    node.append(content, meta);
    $("messages").append(node);
    node.scrollIntoView({ block: "end" });
    return node;
  }

  function samplingFields() {
    const fields = {};
    for (const [id, parse] of [["temperature", Number], ["top_p", Number], ["top_k", parseInt],
                               ["max_tokens", parseInt], ["seed", parseInt]]) {
      const raw = $(id).value.trim();
      if (raw !== "") fields[id] = parse(raw, 10);
    }
    return fields;
  }

  function requestBody() {
    const system = $("system").value.trim();
    const messages = system ? [{ role: "system", content: system }] : [];
    return {
      model: state.model,
      messages: messages.concat(state.history),
      stream: true,
      stream_options: { include_usage: true },
      ...samplingFields(),
    };
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function streamReply(node, body, signal) {
    const content = node.querySelector(".content");
    const started = performance.now();
    const reply = { text: "", firstAt: null, usage: null, finish: null };
    const response = await api("/v1/chat/completions",
                               { method: "POST", body: JSON.stringify(body), signal });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = (chunk.choices || [])[0];
      const delta = choice && choice.delta && choice.delta.content;
      if (delta) {
        if (reply.firstAt === null) reply.firstAt = performance.now();
        reply.text += delta;
        content.textContent = reply.text;
        node.scrollIntoView({ block: "end" });
      }
      if (choice && choice.finish_reason) reply.finish = choice.finish_reason;
      if (chunk.usage) reply.usage = chunk.usage;
    }
    reply.seconds = (performance.now() - started) / 1000;
    reply.ttftMs = reply.firstAt === null ? null : reply.firstAt - started;
    return reply;
  }

  function describe(reply) {
    const tokens = reply.usage ? reply.usage.completion_tokens : null;
    const parts = [];
    if (tokens !== null) parts.push(`${tokens} tokens`);
    if (reply.ttftMs !== null) parts.push(`first token ${reply.ttftMs.toFixed(0)} ms`);
    if (tokens) parts.push(`${(tokens / reply.seconds).toFixed(1)} tok/s`);
    if (reply.finish) parts.push(`finish: ${reply.finish}`);
    return parts.join(" · ");
  }

  async function send(text) {
    if (!state.model) await connect();
    if (!state.model) return;
    state.history.push({ role: "user", content: text });
    addMessage("user", text);
    const node = addMessage("assistant", "");
    node.dataset.state = "streaming";
    state.controller = new AbortController();
    setBusy(true);
    const meta = node.querySelector(".meta");
    try {
      const reply = await streamReply(node, requestBody(), state.controller.signal);
      state.history.push({ role: "assistant", content: reply.text });
      meta.textContent = describe(reply);
      node.dataset.state = "done";
    } catch (e) {
      const partial = node.querySelector(".content").textContent;
      if (partial) state.history.push({ role: "assistant", content: partial });
      else state.history.pop();  // NOTE: no reply: forget the question too, so a retry is clean
      const stopped = e.name === "AbortError";
      meta.textContent = stopped ? "stopped" : `error: ${e.message}`;
      if (!stopped) node.classList.add("error");
      node.dataset.state = stopped ? "stopped" : "error";
    } finally {
      state.controller = null;
      setBusy(false);
    }
  }

  function onSubmit(event) {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  }

  function onPromptKey(event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  }

  function clearChat() {
    if (state.controller) state.controller.abort();
    state.history = [];
    for (const node of [...$("messages").querySelectorAll(".message")]) node.remove();
    $("empty").hidden = false;
  }

  // ---- start -----------------------------------------------------------------------------
  $("composer").addEventListener("submit", onSubmit);
  $("prompt").addEventListener("keydown", onPromptKey);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", clearChat);
  $("key-button").addEventListener("click", () => askForKey("API key for this server:", true));
  $("key-dialog").addEventListener("close", onKeyDialogClose);
  connect();
  refreshStats();
})();
