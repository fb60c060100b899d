"""The annotation web page (one self-contained HTML document; app.py fills in __CONFIG__).

The two renders play as one: a single play/pause/seek control drives both, the left video is
the clock and the right one follows it (a small rate change for small drift, a seek for large),
and only the left one is heard (the right is muted: both carry the same speech). Choices are
made with the keys listed on the page or its buttons; `window.annotate` holds the page's state
for scripted checks.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>avatarstream annotate</title>
<style>
  body { font: 15px/1.4 system-ui, sans-serif; margin: 0 auto; max-width: 1200px; padding: 12px 20px; }
  header { display: flex; gap: 18px; align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  #progress { font-weight: 600; }
  .videos { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; margin: 10px 0; }
  figure { margin: 0; }
  video { width: 100%; background: #111; aspect-ratio: 1; object-fit: contain; }
  figcaption { text-align: center; color: #555; }
  #text { font-size: 17px; min-height: 1.4em; margin: 8px 0; }
  .controls, .choices { display: flex; gap: 10px; align-items: center; margin: 8px 0; }
  #seek { flex: 1; }
  .choices button { flex: 1; padding: 10px; font-size: 15px; }
  kbd { border: 1px solid #999; border-radius: 3px; padding: 0 4px; font-size: 13px; }
  #status.error { color: #b00; }
  #finished { font-size: 20px; font-weight: 600; }
</style>
</head>
<body>
<header>
  <h1>avatarstream annotate</h1>
  <span>pairs: <span id="folder"></span></span>
  <span id="progress"></span>
  <label>annotator <input id="annotator" autocomplete="username" placeholder="your name" maxlength="100"></label>
</header>
<main id="judge" hidden>
  <p>Which render is better? Pair <span id="pairid"></span></p>
  <p id="text"></p>
  <div class="videos">
    <figure><video id="left" playsinline preload="auto"></video><figcaption>left (heard)</figcaption></figure>
    <figure><video id="right" playsinline preload="auto" muted></video><figcaption>right (muted)</figcaption></figure>
  </div>
  <div class="controls">
    <button id="play" type="button">play</button>
    <input id="seek" type="range" min="0" max="0" step="0.01" value="0" aria-label="position">
    <span id="time">0.00 / 0.00 s</span>
  </div>
  <div class="choices">
    <button type="button" data-choice="left">left is better <kbd>&larr;</kbd> <kbd>1</kbd></button>
    <button type="button" data-choice="tie">tie <kbd>t</kbd> <kbd>3</kbd></button>
    <button type="button" data-choice="skip">skip <kbd>s</kbd> <kbd>4</kbd></button>
    <button type="button" data-choice="right">right is better <kbd>&rarr;</kbd> <kbd>2</kbd></button>
    <button type="button" id="undo">undo <kbd>u</kbd></button>
  </div>
  <p class="keys">Keys: <kbd>&larr;</kbd>/<kbd>1</kbd> left, <kbd>&rarr;</kbd>/<kbd>2</kbd> right,
    <kbd>t</kbd>/<kbd>3</kbd> tie, <kbd>s</kbd>/<kbd>4</kbd> skip, <kbd>space</kbd>/<kbd>p</kbd> play or pause,
    <kbd>r</kbd> replay from the start, <kbd>u</kbd>/<kbd>Backspace</kbd> undo the last choice.</p>
</main>
<p id="finished" hidden>all pairs judged</p>
<p id="status" role="status"></p>
<script>
"use strict";
const cfg = __CONFIG__;
const $ = (id) => document.getElementById(id);
const L = $("left"), R = $("right"), nameBox = $("annotator");
L.muted = false;
R.muted = true;
R.defaultMuted = true;
const st = window.annotate = { pair: null, done: 0, total: cfg.total, busy: false, finished: false,
                               canUndo: false, drift: 0, last: null };
$("folder").textContent = cfg.folder;
nameBox.value = cfg.annotator || localStorage.getItem("avatarstream.annotator") || "";
const name = () => nameBox.value.trim();

function status(msg, error) {
  $("status").textContent = msg;
  $("status").className = error ? "error" : "";
}

async function call(method, url, body) {
  const init = { method, headers: {} };
  if (body) { init.headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
  const r = await fetch(url, init);
  const j = await r.json().catch(() => ({ error: r.status + " " + r.statusText }));
  if (!r.ok) throw new Error(j.error || r.statusText);
  return j;
}

function show(s) {
  const same = st.pair && s.pair && st.pair.id === s.pair.id && st.pair.left === s.pair.left;
  Object.assign(st, { done: s.done, total: s.total, pair: s.pair, canUndo: s.can_undo,
                      finished: s.pair === null && s.annotator !== "" });
  $("progress").textContent = `${s.done} of ${s.total} judged`;
  $("undo").disabled = !s.can_undo;
  $("judge").hidden = !s.pair;
  $("finished").hidden = !st.finished;
  if (!s.pair) { pause(); L.removeAttribute("src"); R.removeAttribute("src"); return; }
  $("pairid").textContent = s.pair.id;
  $("text").textContent = s.pair.text || "(no text)";
  if (!same) { L.src = s.pair.left; R.src = s.pair.right; $("seek").value = 0; }
}

async function refresh() {
  if (!name()) { show({ done: 0, total: cfg.total, pair: null, can_undo: false, annotator: "" });
                 status("type your name to start"); return; }
  localStorage.setItem("avatarstream.annotator", name());
  try { show(await call("GET", "/api/state?annotator=" + encodeURIComponent(name()))); status(""); }
  catch (e) { status(e.message, true); }
}

async function post(url, body, done) {
  if (st.busy) return;
  if (!name()) { nameBox.focus(); status("type your name first", true); return; }
  st.busy = true;
  try { show(await call("POST", url, Object.assign({ annotator: name() }, body))); status(done); }
  catch (e) { status(e.message, true); }
  finally { st.busy = false; }
}

function choose(choice) {
  if (!st.pair) return;
  st.last = { pair: st.pair.id, choice };
  post("/api/choice", { pair: st.pair.id, choice }, `${st.pair.id}: ${choice}`);
}
function undo() { if (st.canUndo) post("/api/undo", {}, "last choice undone"); }

// -- one transport for both videos: the left one is the clock --------------------------------
function seek(t) { L.currentTime = t; R.currentTime = t; }
async function play() {
  if (!st.pair) return;
  if (L.ended || (L.duration && L.currentTime >= L.duration - 0.05)) seek(0);
  R.currentTime = L.currentTime;
  R.playbackRate = 1;
  try { await Promise.all([L.play(), R.play()]); } catch (e) { status("cannot play: " + e.message, true); }
}
function pause() { L.pause(); R.pause(); if (L.readyState) R.currentTime = L.currentTime; }
function toggle() { if (L.paused) play(); else pause(); }
L.addEventListener("play", () => { $("play").textContent = "pause"; });
L.addEventListener("pause", () => { $("play").textContent = "play"; R.pause(); });
L.addEventListener("ended", () => R.pause());
L.addEventListener("loadedmetadata", () => { $("seek").max = L.duration || 0; });
$("play").addEventListener("click", toggle);
$("seek").addEventListener("input", (e) => seek(Number(e.target.value)));
function tick() {
  if (L.readyState && R.readyState) {
    st.drift = R.currentTime - L.currentTime;
    if (!L.paused && !R.paused) {
      const d = Math.abs(st.drift);
      if (d > 0.25) { R.currentTime = L.currentTime; R.playbackRate = 1; }
      else if (d > 0.02) R.playbackRate = st.drift > 0 ? 0.9 : 1.1;
      else R.playbackRate = 1;
    } else if (!L.paused && R.paused && !R.ended) R.play().catch(() => {});
  }
  if (document.activeElement !== $("seek")) $("seek").value = L.currentTime;
  $("time").textContent = `${L.currentTime.toFixed(2)} / ${(L.duration || 0).toFixed(2)} s`;
  requestAnimationFrame(tick);
}
requestAnimationFrame(tick);

// -- choices: keys and buttons -------------------------------------------------------------------
const KEYS = { ArrowLeft: "left", "1": "left", ArrowRight: "right", "2": "right",
               t: "tie", "3": "tie", s: "skip", "4": "skip" };
document.addEventListener("keydown", (e) => {
  if (e.target === nameBox) { if (e.key === "Enter") nameBox.blur(); return; }
  if (e.ctrlKey || e.metaKey || e.altKey || e.repeat) return;
  const k = e.key.length === 1 ? e.key.toLowerCase() : e.key;
  if (KEYS[k]) choose(KEYS[k]);
  else if (k === " " || k === "p") toggle();
  else if (k === "r") { seek(0); play(); }
  else if (k === "u" || k === "Backspace") undo();
  else return;
  e.preventDefault();
});
for (const b of document.querySelectorAll("button[data-choice]"))
  b.addEventListener("click", () => { b.blur(); choose(b.dataset.choice); });
$("undo").addEventListener("click", () => { $("undo").blur(); undo(); });
$("play").addEventListener("mouseup", () => $("play").blur());
nameBox.addEventListener("change", refresh);
refresh();
</script>
</body>
</html>
"""
