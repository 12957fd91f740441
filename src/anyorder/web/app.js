// The page of `anyorder serve`. It never samples: it sends the request, then draws the
// server-sent events of the real sampler (start, one step per forward pass, done/error;
// speculative decoding: a round before each step, with the drafts the pass checked).
"use strict";

const $ = (id) => document.getElementById(id);
let info = null;
let controller = null;
let run = null; // the generation on screen: {n, total, eos, cells, t0, speculative, round, hold}
const SPECULATIVE_MODES = ["l2r", "random"];
let slowMotion = 0; // the request's delay_ms

// Events are drawn in order; in slow motion a round's drafts stay on screen (pending) for
// part of the pause before its verdict (the step event that follows) is drawn.
const queue = [];
let holding = false;

function drain() {
  while (!holding && queue.length) {
    const [event, data] = queue.shift();
    handle(event, data);
  }
}

function enqueue(event, data) {
  queue.push([event, data]);
  drain();
}

function hold(ms) {
  holding = true;
  setTimeout(() => {
    holding = false;
    drain();
  }, ms);
}

async function drained() {
  while (holding || queue.length) await new Promise((r) => setTimeout(r, 20));
}

function setState(state, text) {
  document.body.dataset.state = state;
  $("state-text").textContent = text || "";
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// Whitespace and special tokens made visible inside a cell.
function visible(piece, token) {
  if (run && token === run.eos) return "⟨eos⟩";
  if (piece === "") return "∅";
  return piece
    .replace(/ /g, "␣")
    .replace(/\n/g, "↵")
    .replace(/\t/g, "⇥")
    .replace(/[\u0000-\u001f]/g, (c) => String.fromCharCode(0x2400 + c.charCodeAt(0)));
}

// Step s of T as a colour: early steps blue, late steps orange.
function stepColour(step, total) {
  const f = total > 1 ? Math.min(step / (total - 1), 1) : 0;
  return `hsl(${Math.round(215 - 190 * f)}, 85%, 74%)`;
}

function chatOn() {
  return $("chat").checked;
}

// In chat mode the text is a message (its "[MASK" is text), never a template.
function isTemplate() {
  return !chatOn() && $("text").value.includes("[MASK");
}

function speculativeOn() {
  return Boolean(info && info.speculative) && SPECULATIVE_MODES.includes($("mode").value) &&
    $("speculative").checked;
}

function syncModeInputs() {
  const mode = $("mode").value;
  $("streams-box").hidden = mode !== "strided";
  $("steps-box").hidden = mode !== "lemma1";
  // speculative decoding follows one order (l2r or random) on a model that drafts ahead
  $("spec-box").hidden = !(info && info.speculative) || !SPECULATIVE_MODES.includes(mode);
  $("draft-box").hidden = !speculativeOn();
  // A template sets its own length (its text plus its holes): no field to ignore.
  $("length-box").hidden = isTemplate();
  $("length-note").hidden = !isTemplate();
  // a chat's length is its answer's: the prompt comes with the template
  $("length-label").textContent = chatOn() ? "Answer length" : "Length";
}

async function loadInfo() {
  try {
    const r = await fetch("/api/info");
    info = await r.json();
  } catch (e) {
    showError(`cannot reach the server: ${e}`);
    setState("error");
    return;
  }
  const params = (info.params / 1e6).toFixed(2);
  $("model-info").textContent =
    `${info.kind}, ${params}M parameters, context ${info.seq_len} tokens ` +
    `(${info.tokenizer}), step ${info.step} — ${info.path}`;
  for (const opt of $("mode").options) opt.disabled = !info.modes.includes(opt.value);
  $("mode").value = info.modes.includes("random") ? "random" : info.modes[0];
  $("length").max = info.seq_len;
  $("length").value = Math.min(128, info.seq_len);
  $("samples").max = info.limits.max_samples;
  $("delay").max = info.limits.max_delay_ms;
  $("draft").max = info.limits.max_draft;
  syncModeInputs();
  setState("ready");
}

function number(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? null : parse(raw);
}

function requestBody() {
  const mode = $("mode").value;
  const topP = number("top-p", parseFloat);
  return {
    text: $("text").value,
    mode,
    streams: mode === "strided" ? number("streams", Number) : null,
    steps: mode === "lemma1" ? number("steps", Number) : null,
    speculative: speculativeOn() ? number("draft", Number) : null,
    chat: chatOn(),
    length: isTemplate() || chatOn() ? null : number("length", Number),
    max_new_tokens: chatOn() ? number("length", Number) : null,
    temperature: number("temperature", parseFloat) ?? 1.0,
    top_p: topP === null || topP >= 1 ? null : topP,
    seed: number("seed", Number) ?? 0,
    num_samples: number("samples", Number) ?? 1,
    delay_ms: number("delay", Number) ?? 0,
  };
}

function onStart(d) {
  run = {
    n: d.n, total: d.total_steps, eos: d.eos_id, cells: [], t0: performance.now(),
    speculative: d.speculative, round: null, hold: slowMotion > 0 ? Math.min(slowMotion / 2, 250) : 0,
  };
  const out = $("samples-out");
  out.textContent = "";
  for (let i = 0; i < d.num_samples; i++) {
    const box = document.createElement("section");
    box.className = "sample";
    const h = document.createElement("h2");
    h.textContent = d.num_samples > 1 ? `sample ${i + 1}` : "sample";
    const grid = document.createElement("div");
    grid.className = "grid";
    grid.id = `grid-${i}`;
    const cells = [];
    for (let p = 0; p < d.n; p++) {
      const c = document.createElement("span");
      c.className = "cell pending";
      c.textContent = "·";
      c.title = `position ${p}: not decided yet`;
      grid.appendChild(c);
      cells.push(c);
    }
    for (const [p, tok, piece] of d.prompt) {
      cells[p].className = "cell known";
      cells[p].textContent = visible(piece, tok);
      cells[p].title = `position ${p}: prompt, token ${tok}`;
    }
    const final = document.createElement("div");
    final.className = "final";
    final.hidden = true;
    final.innerHTML =
      `<textarea id="final-${i}" readonly rows="4"></textarea>` +
      `<button type="button" class="copy" id="copy-${i}">Copy</button>`;
    box.append(h, grid, final);
    out.appendChild(box);
    run.cells.push(cells);
  }
  $("legend-first").textContent = "1";
  $("legend-last").textContent = String(d.total_steps);
  $("legend").hidden = Boolean(d.speculative);
  $("spec-legend").hidden = !d.speculative;
  $("spec-counter").hidden = !d.speculative;
  $("spec-counter").textContent = `speculative, K = ${d.speculative}`;
}

function specCounter(passes, drafted, accepted) {
  const rate = drafted ? ` (${Math.round((100 * accepted) / drafted)}%)` : "";
  $("spec-counter").textContent =
    `${passes} passes / ${drafted} drafted / ${accepted} accepted${rate}`;
}

// A speculative round: the drafts this pass checked, shown pending until its step event
// draws the verdict.
function onRound(d) {
  d.rows.forEach((row, i) => {
    for (const [p, tok, piece] of row.drafts) {
      const c = run.cells[i][p];
      c.className = "cell drafted";
      c.textContent = visible(piece, tok);
      c.style.background = "";
      c.title = `position ${p}: drafted ${tok}, being checked in pass ${d.pass}`;
    }
  });
  run.round = d;
  specCounter(d.passes, d.drafted, d.accepted);
  if (run.hold > 0) hold(run.hold);
}

// The verdict of a round on one sample's decided cell: accepted draft, or the token that
// closed the round (replacing a rejected draft, or a bonus draw when all were accepted).
function drawVerdict(c, row, p, tok, piece, pass) {
  const closing = row.closing && row.closing[0] === p;
  c.style.background = "";
  if (!closing) {
    c.className = "cell decided accepted";
    c.title = `position ${p}: draft ${tok} accepted in pass ${pass}`;
  } else if (row.replaced) {
    const draft = row.drafts[row.accepted];
    const s = document.createElement("s");
    s.textContent = visible(draft[2], draft[1]);
    c.className = "cell decided replaced closing";
    c.textContent = "";
    c.append(s, visible(piece, tok));
    c.title = `position ${p}: draft ${draft[1]} rejected in pass ${pass}, replaced by ${tok}`;
  } else {
    c.className = "cell decided bonus closing";
    const why = row.drafts.length ? "every draft accepted" : "no drafts to check";
    c.title = `position ${p}: token ${tok} drawn in pass ${pass} (${why})`;
  }
}

// Drafts after a rejected one are thrown away: struck through until decided later.
function drawDiscarded(cells, row, pass) {
  for (const [p, tok, piece] of row.drafts.slice(row.accepted + 1)) {
    cells[p].className = "cell discarded";
    cells[p].textContent = visible(piece, tok);
    cells[p].title = `position ${p}: draft ${tok} discarded in pass ${pass} (after a rejection)`;
  }
}

function onStep(d) {
  const round = run.round;
  run.round = null;
  d.rows.forEach((row, i) => {
    for (const [p, tok, piece] of row) {
      const c = run.cells[i][p];
      c.className = "cell decided";
      c.textContent = visible(piece, tok);
      c.style.background = stepColour(d.step, run.total);
      c.title = `position ${p}: step ${d.step + 1} of ${run.total} (pass ${d.pass}), token ${tok}`;
      if (round) drawVerdict(c, round.rows[i], p, tok, piece, d.pass);
    }
    if (round && round.rows[i].replaced) drawDiscarded(run.cells[i], round.rows[i], d.pass);
  });
  // a speculative run's passes depend on its acceptances: no total to count towards
  $("step-counter").textContent = run.speculative
    ? `pass ${d.step + 1}`
    : `step ${d.step + 1} / ${run.total}`;
  $("passes").textContent = `${d.pass} forward passes, ${d.generated} tokens`;
  const rate = d.elapsed_s > 0 ? d.generated / d.elapsed_s : 0;
  $("rate").textContent = `${Math.round(rate).toLocaleString("en")} tokens/s`;
}

function onDone(d) {
  d.texts.forEach((text, i) => {
    $(`final-${i}`).value = text;
    $(`final-${i}`).parentElement.hidden = false;
    $(`copy-${i}`).addEventListener("click", () => copyText(i));
  });
  $("passes").textContent = `${d.forward_passes} forward passes, ${d.generated} tokens`;
  if (d.speculative) {
    const sum = (xs) => xs.reduce((a, b) => a + b, 0);
    const s = d.speculative;
    specCounter(sum(s.passes), sum(s.drafted), sum(s.accepted));
  }
  $("rate").textContent = `${Math.round(d.tokens_per_s).toLocaleString("en")} tokens/s`;
  setState("done", `done in ${d.seconds.toFixed(2)} s`);
}

async function copyText(i) {
  const area = $(`final-${i}`);
  try {
    await navigator.clipboard.writeText(area.value);
  } catch (e) {
    area.select(); // no clipboard API (an insecure origin): the old way
    document.execCommand("copy");
  }
  $(`copy-${i}`).textContent = "Copied";
  setTimeout(() => ($(`copy-${i}`).textContent = "Copy"), 1500);
}

function handle(event, data) {
  if (event === "start") onStart(data);
  else if (event === "round") onRound(data);
  else if (event === "step") onStep(data);
  else if (event === "done") onDone(data);
  else if (event === "error") {
    showError(data.message);
    setState("error", "stopped");
  }
}

// One server-sent event: "event: NAME\ndata: JSON".
function parseEvent(chunk) {
  let event = "message";
  const data = [];
  for (const line of chunk.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trim());
  }
  return [event, data.length ? JSON.parse(data.join("\n")) : null];
}

async function generate(ev) {
  ev.preventDefault();
  clearError();
  queue.length = 0;
  $("samples-out").textContent = "";
  $("legend").hidden = true;
  $("spec-legend").hidden = true;
  $("spec-counter").hidden = true;
  $("step-counter").textContent = "step –";
  $("passes").textContent = "–";
  $("rate").textContent = "– tokens/s";
  setState("running", "generating…");
  $("generate").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  const body = requestBody();
  slowMotion = body.delay_ms || 0;
  try {
    const r = await fetch("/api/generate", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      let message = `${r.status} ${r.statusText}`;
      try {
        message = (await r.json()).error || message;
      } catch (e) {
        /* not JSON: keep the status line */
      }
      showError(message);
      setState("error", `refused (${r.status})`);
      return;
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
        const [event, data] = parseEvent(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        enqueue(event, data);
      }
    }
    await drained();
    if (document.body.dataset.state === "running") {
      showError("the stream ended before the sample was finished");
      setState("error");
    }
  } catch (e) {
    if (e.name === "AbortError") {
      queue.length = 0;
      setState("stopped", "stopped");
    }
    else {
      showError(`cannot reach the server: ${e.message}`);
      setState("error");
    }
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("mode").addEventListener("change", syncModeInputs);
$("speculative").addEventListener("change", syncModeInputs);
$("text").addEventListener("input", syncModeInputs);
$("chat").addEventListener("change", syncModeInputs);
loadInfo();
