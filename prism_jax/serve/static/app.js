// The PRISM explorer page: talks to the JSON API of prism_jax/serve/app.py. No network
// beyond this server, no libraries.
"use strict";
const $ = (id) => document.getElementById(id);
const TOKEN = new URLSearchParams(location.search).get("token");
// The token leaves the address bar and history; the server's HttpOnly cookie carries it on.
if (TOKEN) history.replaceState(null, "", location.pathname);
const HEADERS = TOKEN ? { Authorization: "Bearer " + TOKEN } : {};
const S = { gen: null, steeredGen: null, gains: {}, uploaded: null, selected: null, status: null };

function hue(id) { return `hsl(${(id * 137.508) % 360}, 65%, 45%)`; }
function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c])); }
function shown(s) { return s.replace(/\n/g, "⏎\n"); }
function fmt(x) { return x === null || x === undefined ? "–" : (x >= 0 ? "+" : "") + x.toFixed(3); }

async function api(path, body) {
  const opts = body === undefined ? { headers: HEADERS }
    : { method: "POST", headers: { ...HEADERS, "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const r = await fetch(path, opts);
  const data = await r.json();
  if (r.status >= 400) throw new Error(data.error || r.statusText);
  return [data, r.status];
}

function knobs() {
  return {
    prompt: $("prompt").value, max_new_tokens: +$("max_new").value, temperature: +$("temperature").value,
    top_k: +$("top_k").value, seed: +$("seed").value, greedy: $("greedy").checked,
  };
}

// One streamed generation into `el`; returns {prompt, tokens, ids}.
async function streamInto(el, body, onToken) {
  el.innerHTML = "";
  const r = await fetch("api/generate", {
    method: "POST", headers: { ...HEADERS, "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (r.status >= 400) throw new Error((await r.json()).error);
  const gen = { prompt: [], tokens: [], ids: null, gains: body.gains || {} };
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const msg = JSON.parse(buf.slice(0, nl));
      buf = buf.slice(nl + 1);
      if (msg.prompt) {
        gen.prompt = msg.prompt;
        gen.how = msg.how;
        for (const t of msg.prompt) el.append(tokSpan(t, null, true));
      } else if (msg.done) {
        gen.ids = msg.ids;
        gen.compiles = msg.compiles;
      } else {
        gen.tokens.push(msg);
        el.append(tokSpan(msg, gen, false));
        if (onToken) onToken(msg);
      }
    }
  }
  return gen;
}

function tokSpan(t, gen, isPrompt) {
  const s = document.createElement("span");
  s.className = "tok" + (isPrompt ? " prompt" : "") + (!isPrompt && !t.agrees ? " resid" : "");
  s.textContent = shown(t.text);
  if (!isPrompt) {
    const top = t.slices[0];
    if (top) s.style.setProperty("--c", hue(top.id));
    s.dataset.i = t.i;
    s.title = `logit ${t.logit.toFixed(3)}; ${t.agrees ? "prototypes agree" : "the residual decided"} (${t.trust})`;
    s.onclick = () => showWhy(t, gen, s);
  }
  return s;
}

async function generate(ev) {
  if (ev) ev.preventDefault();
  $("genmsg").textContent = "generating…";
  $("genmsg").className = "msg";
  try {
    S.gen = await streamInto($("output"), knobs());
    const resid = S.gen.tokens.filter((t) => !t.agrees).length;
    $("genmsg").textContent = `${S.gen.tokens.length} tokens (${S.gen.how}); the residual decided ${resid} of them`;
  } catch (e) { $("genmsg").textContent = e.message; $("genmsg").className = "msg err"; }
}

function showWhy(t, gen, span) {
  document.querySelectorAll(".tok.sel").forEach((x) => x.classList.remove("sel"));
  span.classList.add("sel");
  S.selected = { t, gen };
  $("why").hidden = false;
  $("whytok").textContent = JSON.stringify(t.text);
  $("whytrust").innerHTML = t.agrees
    ? `the prototypes pick this prediction (${esc(t.trust)})`
    : `<span class="err">the residual decided</span>: the prototypes alone would predict ${esc(JSON.stringify(t.prediction_text))}; their slices do not explain it`;
  const parts = t.slices.map((s) => ({ name: `#${s.id}`, v: s.contrib, c: hue(s.id), s }));
  parts.push({ name: "residual", v: t.residual, c: "#9e9e9e" });
  const tot = parts.reduce((a, p) => a + Math.abs(p.v), 0) || 1;
  $("bar").innerHTML = parts.map((p) => `<div title="${p.name} ${fmt(p.v)}" style="width:${(100 * Math.abs(p.v) / tot).toFixed(2)}%;background:${p.c};opacity:${p.v < 0 ? 0.45 : 1}"></div>`).join("");
  const rows = t.slices.map((s) => `<tr class="slice" data-v="${s.contrib}"><td><a class="p" data-p="${s.id}" style="color:${hue(s.id)}">#${s.id}</a>${s.gain !== 1 ? ` ×${s.gain}` : ""}</td><td>${esc(s.label)}</td><td class="num">${s.act.toFixed(3)}</td><td class="num">${fmt(s.contrib)}</td></tr>`);
  rows.push(`<tr class="slice" data-v="${t.residual}"><td>residual</td><td>W r</td><td></td><td class="num">${fmt(t.residual)}</td></tr>`);
  $("slices").tBodies[0].innerHTML = rows.join("");
  const sum = parts.reduce((a, p) => a + p.v, 0);
  $("sumline").innerHTML = `Σ slices = <b id="slicesum">${sum.toFixed(4)}</b>; logit = <b id="logitval">${t.logit.toFixed(4)}</b>`;
  $("attribout").innerHTML = "";
  document.querySelectorAll("#slices a.p").forEach((a) => (a.onclick = () => showProto(+a.dataset.p)));
}

async function attribute() {
  const { t, gen } = S.selected;
  const ids = (gen.ids || gen.prompt.map((p) => p.id).concat(gen.tokens.map((x) => x.id))).slice(0, t.i + 1);
  const out = $("attribout");
  for (;;) {
    try {
      const [data, code] = await api("api/attribute", { ids, position: t.i, top: 5 });
      if (code === 202) {
        const p = data.rows ? ` pass ${data.pass}: ${data.rows_done}/${data.rows} rows` : "";
        out.innerHTML = `<div class="msg">building the attribution cache…${p}</div>`;
        await new Promise((r) => setTimeout(r, 1000));
        continue;
      }
      out.innerHTML = `<div class="msg">by ${esc(data.method)}</div>` +
        (data.note ? `<div class="err">${esc(data.note)}</div>` : "") + "<ol>" +
        data.sequences.map((s) => `<li>score ${s.score.toExponential(2)} · ${esc(s.name)}<br><code>${esc(s.before)}<span class="span">${esc(s.span)}</span>${esc(s.after)}</code></li>`).join("") + "</ol>";
      return;
    } catch (e) { out.innerHTML = `<div class="err">${esc(e.message)}</div>`; return; }
  }
}

async function showProto(id) {
  try {
    const [p] = await api(`api/prototype/${id}`);
    $("proto").hidden = false;
    $("pid").innerHTML = `<span style="color:${hue(id)}">#${id}</span>`;
    $("pid").dataset.id = id;
    $("plabel").textContent = p.label;
    $("gain").value = S.gains[id] !== undefined ? S.gains[id] : 0;
    const c = p.card;
    $("pusage").textContent = `active on ${(100 * p.usage_val).toFixed(2)}% of validation tokens (${p.val_rows} rows)` +
      (c ? `, ${(100 * c.usage_train).toFixed(2)}% of training tokens` : "");
    const fired = [];
    document.querySelectorAll(".tok.fired").forEach((x) => x.classList.remove("fired"));
    for (const [gen, el] of [[S.gen, "output"], [S.steeredGen, "steered"]]) {
      if (!gen) continue;
      for (const t of gen.tokens) {
        if (t.slices.some((s) => s.id === id)) {
          fired.push(`${el === "output" ? "" : "steered "}${JSON.stringify(t.text)}@${t.i}`);
          const span = document.querySelector(`#${el} .tok[data-i="${t.i}"]`);
          if (span) span.classList.add("fired");
        }
      }
    }
    $("pfired").textContent = fired.length ? `fired in this generation at ${fired.join(", ")}` : "not active in the current generation";
    $("psig").innerHTML = c ? `<div class="sig">${c.promoted.map(([t, v]) => `<span class="up">${esc(JSON.stringify(t))} ${v.toFixed(2)}</span>`).join("")}</div><div class="sig">${c.demoted.map(([t, v]) => `<span class="down">${esc(JSON.stringify(t))} ${v.toFixed(2)}</span>`).join("")}</div>` : "(no cards)";
    $("pctx").innerHTML = c ? c.contexts.slice(0, 8).map((x) => `<li><code>${esc(x.before)}<span class="trig">${esc(x.trigger)}</span>${esc(x.after)}</code> <small>a=${x.activation.toFixed(3)}, doc ${x.document}</small></li>`).join("") : "";
    $("pnear").innerHTML = p.nearest.map((n) => `<a class="p" data-p="${n.id}" style="color:${hue(n.id)}">#${n.id}</a> <small>cos ${n.cos.toFixed(2)}</small>`).join(" · ");
    document.querySelectorAll("#pnear a.p").forEach((a) => (a.onclick = () => showProto(+a.dataset.p)));
  } catch (e) { $("proto").hidden = false; $("plabel").innerHTML = `<span class="err">${esc(e.message)}</span>`; }
}

function renderGains() {
  const ids = Object.keys(S.gains);
  const up = S.uploaded ? ` + uploaded set (${S.uploaded.ids ? S.uploaded.ids.length + " prototypes suppressed" : "gains"})` : "";
  $("gainlist").innerHTML = ids.length || S.uploaded
    ? ids.map((i) => `<a class="p" data-p="${i}">#${i}</a> ×${S.gains[i]}`).join(", ") + up
    : "no gains set: the model as trained";
  document.querySelectorAll("#gainlist a.p").forEach((a) => (a.onclick = () => showProto(+a.dataset.p)));
}

async function regenerate() {
  const body = knobs();
  $("compare").hidden = false;
  $("comparemsg").textContent = "generating…";
  try {
    const base = await streamInto($("base"), body);
    const steeredBody = { ...body, gains: S.gains };
    if (S.uploaded) steeredBody.steering_set = S.uploaded;
    const st = await streamInto($("steered"), steeredBody);
    S.gen = base;
    S.steeredGen = st;
    let changed = 0;
    st.tokens.forEach((t, j) => {
      const b = base.tokens[j];
      if (!b || b.id !== t.id) {
        changed++;
        document.querySelector(`#steered .tok[data-i="${t.i}"]`).classList.add("changed");
        if (b) document.querySelector(`#base .tok[data-i="${b.i}"]`).classList.add("changed");
      }
    });
    const [dec] = await api("api/decompose", { ids: st.ids, gains: S.gains, ...(S.uploaded ? { steering_set: S.uploaded } : {}) });
    const effects = dec.tokens.filter((x) => x.i >= st.prompt.length).map((x) => x.logit - x.logit_unedited);
    effects.forEach((d, j) => {
      const span = document.querySelector(`#steered .tok[data-i="${st.tokens[j].i}"]`);
      if (span) { span.dataset.effect = d.toFixed(4); span.title += `; the edit moved its logit by ${fmt(d)}`; }
    });
    const moved = effects.filter((d) => Math.abs(d) > 1e-6).length;
    $("comparemsg").innerHTML = `same seed; <b id="nchanged">${changed}</b> of ${st.tokens.length} tokens changed (marked); the edit moved ${moved} steered tokens' logits (hover a token)`;
  } catch (e) { $("comparemsg").textContent = e.message; $("comparemsg").className = "msg err"; }
}

function download() {
  const blob = new Blob([JSON.stringify({ format: "prism_jax.steering/1", gains: S.gains }, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "steering.json";
  a.click();
}

async function upload(ev) {
  const f = ev.target.files[0];
  if (!f) return;
  try {
    const obj = JSON.parse(await f.text());
    if (obj.format === "prism_jax.steering/1") {
      for (const [i, g] of Object.entries(obj.gains || {})) S.gains[i] = g;
    } else {
      S.uploaded = obj; // checked by the server (another model's set is refused)
    }
    renderGains();
  } catch (e) { $("gainlist").innerHTML = `<span class="err">not a steering set: ${esc(e.message)}</span>`; }
}

async function search(ev) {
  ev.preventDefault();
  $("results").hidden = false;
  try {
    const [r] = await api("api/search?q=" + encodeURIComponent($("search").value));
    $("reslist").innerHTML = r.results.map((x) => `<li><a class="p" data-p="${x.id}" style="color:${hue(x.id)}">#${x.id}</a> ${esc(x.label)} <small>${esc(x.why)}</small></li>`).join("") || "<li>nothing found</li>";
    document.querySelectorAll("#reslist a.p").forEach((a) => (a.onclick = () => showProto(+a.dataset.p)));
  } catch (e) { $("reslist").innerHTML = `<li class="err">${esc(e.message)}</li>`; }
}

async function init() {
  try {
    const [st] = await api("api/status");
    S.status = st;
    $("runinfo").textContent = `${st.run}: d ${st.d_model} × ${st.layers} layers, K ${st.prototypes}, k ${st.k}, context ${st.context}; cache: ${st.cache.state}`;
    $("top_k").max = st.vocab;
  } catch (e) { $("runinfo").textContent = e.message; }
  $("genform").onsubmit = generate;
  $("attrib").onclick = attribute;
  $("setgain").onclick = () => { S.gains[$("pid").dataset.id] = +$("gain").value; renderGains(); };
  $("regen").onclick = regenerate;
  $("cleargains").onclick = () => { S.gains = {}; S.uploaded = null; renderGains(); };
  $("download").onclick = download;
  $("upload").onchange = upload;
  $("searchform").onsubmit = search;
}
document.addEventListener("DOMContentLoaded", init);
