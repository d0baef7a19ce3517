"""The report's single HTML page: inline CSS and JS, SVG drawn by the JS from embedded JSON.

`render(data)` returns the page; `data` is report.report_data's dict (its keys are listed
there). Nothing is fetched: no external script, style, font or image, so the page opens
from disk and makes no network request. The DOM the browser tests read:
  span.tok[data-i]                   a token (click: its decomposition in #detail); class
                                     "resid" when the residual decided the prediction there
  #residonly                         checkbox: dim every token the prototypes decided
  #trust[data-agrees]                the selected token's trust line
  #logit[data-value]                 the selected token's logit
  #bar rect.slice[data-proto][data-value]   one slice per active prototype + "residual"
  #detail .proto-row                 per prototype: label, snippets, signature, card link
  #map circle.pt[data-proto]         the K prototypes on the map
  #cardlist li[data-proto]           the searchable card list (#search filters it)
  #card                              the open card
"""

from __future__ import annotations

import html
import json

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:10px 18px;background:#263238;color:#eee}
header h1{font-size:18px;margin:0 0 4px}
header .faith{font-size:12px;color:#b0bec5}
main{display:grid;grid-template-columns:minmax(420px,1.2fr) minmax(380px,1fr);gap:14px;
 padding:14px}
section{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 12px}
h2{font-size:15px;margin:0 0 8px}
#text{font:15px/2.1 ui-monospace,monospace;white-space:pre-wrap;word-break:break-word}
.tok{cursor:pointer;border-radius:3px;padding:1px 0;border-bottom:2px solid transparent}
.tok.prompt{opacity:.75;border-bottom-color:#999}
.tok.sel{outline:2px solid #000}
.tok.resid{border-bottom:2px dashed #c62828}
.tok.dim{opacity:.18}
#trust.resid{color:#c62828;font-weight:600}
.first{color:#777}
table{border-collapse:collapse;width:100%;font-size:12px}
td,th{border-bottom:1px solid #eee;padding:3px 4px;vertical-align:top;text-align:left}
td.num{text-align:right;font-family:ui-monospace,monospace;white-space:nowrap}
mark{background:#ffe082;padding:0 1px}
.snip{font-family:ui-monospace,monospace;font-size:11px;color:#444;white-space:pre-wrap}
.label{color:#6a1b9a}
.muted{color:#888;font-size:12px}
#cardlist{max-height:260px;overflow:auto;margin:6px 0 0;padding:0;list-style:none;
 font-size:12px}
#cardlist li{cursor:pointer;padding:2px 4px}
#cardlist li:hover{background:#eef}
a{color:#1565c0;cursor:pointer}
.pt{cursor:pointer}
.legend{font-size:11px;color:#666}
"""

JS = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const $ = s => document.querySelector(s);
const esc = s => String(s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;',
  '"':'&quot;',"'":'&#39;'}[c]));
const vis = s => esc(s).replace(/\n/g, '\u21b5\n').replace(/\t/g, '\u2192');
const inline = s => esc(s).replace(/\n/g, '\u21b5').replace(/\t/g, '\u2192');  // one line
const fmt = v => (v >= 0 ? '+' : '') + v.toFixed(3);
const SVG = 'http://www.w3.org/2000/svg';
function el(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
const hue = i => (i * 137.508) % 360;
const protoColour = (i, a) => `hsla(${hue(i)},70%,55%,${a})`;
function strHue(s) {  // one colour per label term: prototypes sharing a top term match
  let h = 0;
  for (const ch of s) h = (h * 31 + ch.codePointAt(0)) % 3600;
  return h / 10;
}
function ramp(t) {  // usage colour: light blue -> dark red
  t = Math.max(0, Math.min(1, t));
  return `hsl(${220 - 220 * t},75%,${70 - 35 * t}%)`;
}
const card = i => D.cards[i];
function snippetHtml(c) {
  return `<span class="snip">${inline(c.before)}<mark>${inline(c.trigger)}</mark>` +
         `${inline(c.after)}</span> <span class="muted">a=${c.act.toFixed(3)}</span>`;
}

// --- the text, coloured by top prototype or by prototype-path share ---------------------
function topProto(t) {
  let best = 0;
  for (let j = 1; j < t.protos.length; j++)
    if (t.protos[j].contrib > t.protos[best].contrib) best = j;
  return t.protos.length ? t.protos[best] : null;
}
function colourTokens() {
  const mode = $('#colour').value;
  document.querySelectorAll('span.tok').forEach(s => {
    const t = D.tokens[+s.dataset.i];
    if (mode === 'share') {
      const p = t.protos.reduce((a, q) => a + Math.abs(q.contrib), 0);
      const share = p / (p + Math.abs(t.residual) + 1e-12);
      s.style.background = `hsla(140,60%,45%,${(0.1 + 0.8 * share).toFixed(3)})`;
      s.title = `prototype-path share ${(100 * share).toFixed(0)}%`;
    } else {
      const top = topProto(t);
      s.style.background = top ? protoColour(top.id, 0.35) : '';
      s.title = top ? `#${top.id} ${card(top.id).label}` : '';
    }
  });
}
function drawText() {
  const box = $('#text');
  box.innerHTML = `<span class="first">${vis(D.first_token)}</span>`;
  D.tokens.forEach((t, i) => {
    const s = document.createElement('span');
    s.className = 'tok' + (t.generated ? ' gen' : ' prompt') + (t.trust.agrees ? '' : ' resid');
    s.dataset.i = i;
    s.innerHTML = vis(t.text);
    s.addEventListener('click', () => showToken(i));
    s.addEventListener('mouseenter', () => { if ($('#hover').checked) showToken(i); });
    box.appendChild(s);
  });
  colourTokens();
  filterTokens();
}
function filterTokens() {  // only the tokens the residual decided, when asked
  const only = $('#residonly').checked;
  document.querySelectorAll('span.tok').forEach(s => s.classList.toggle(
      'dim', only && D.tokens[+s.dataset.i].trust.agrees));
}
function trustLine(t) {
  const r = t.trust, share = r.share === null ? 'a tie' : `${(100 * r.share).toFixed(0)}%`;
  return r.agrees ? `trust: the prototypes alone pick the model's top prediction here ` +
      `<code>${vis(r.top1_text)}</code>; their share of its lead over the runner-up: ${share}` :
      `trust: the residual decided the model's top prediction here ` +
      `(<code>${vis(r.top1_text)}</code>; the prototypes alone would pick ` +
      `<code>${vis(r.proto_top1_text)}</code>): the prototypes below do not explain it. ` +
      `Explain it with a method over the whole model (EK-FAC or gradient dot-products).`;
}

// --- one token: the stacked bar of its logit, the prototypes, the attributed sequences ---
function showToken(i) {
  const t = D.tokens[i];
  document.querySelectorAll('span.tok.sel').forEach(s => s.classList.remove('sel'));
  document.querySelector(`span.tok[data-i="${i}"]`).classList.add('sel');
  const parts = t.protos.map(p => ({key: String(p.id), v: p.contrib, id: p.id}));
  parts.push({key: 'residual', v: t.residual, id: null});
  const det = $('#detail');
  det.innerHTML = `<h2>token <code>${vis(t.text)}</code> (id ${t.id}${t.generated ?
      ', generated' : ', prompt'}): logit <span id="logit" data-value="${t.logit}">` +
      `${t.logit.toFixed(4)}</span> = ${parts.length - 1} prototype slices + residual</h2>` +
      `<div id="trust" data-agrees="${t.trust.agrees}" class="${t.trust.agrees ? '' : 'resid'}">` +
      `${trustLine(t)}</div>` +
      '<svg id="bar" width="100%" height="46" viewBox="0 0 600 46"></svg>' +
      '<div class="legend">bar: positive slices stack right of 0, negative left; hover a ' +
      'slice for its prototype</div><table id="ptable"></table><div id="attr"></div>';
  const pos = parts.filter(p => p.v >= 0).reduce((a, p) => a + p.v, 0);
  const neg = parts.filter(p => p.v < 0).reduce((a, p) => a - p.v, 0);
  const scale = 560 / Math.max(pos + neg, 1e-9), zero = 20 + neg * scale;
  const bar = $('#bar');
  let right = zero, left = zero;
  for (const p of parts) {
    const w = Math.abs(p.v) * scale;
    const x = p.v >= 0 ? right : left - w;
    if (p.v >= 0) right += w; else left -= w;
    const r = el('rect', {x: x.toFixed(2), y: 8, width: Math.max(w, 0.5).toFixed(2),
      height: 26, class: 'slice', 'data-proto': p.key, 'data-value': String(p.v),
      fill: p.id === null ? '#9e9e9e' : protoColour(p.id, 0.85), stroke: '#fff'}, bar);
    const tip = p.id === null ? `residual <W_y, r> ${fmt(p.v)}` :
      `#${p.id} ${card(p.id).label} ${fmt(p.v)}\n` +
      (card(p.id).contexts[0] ? card(p.id).contexts[0].text : '');
    el('title', {}, r).textContent = tip;
  }
  el('line', {x1: zero, x2: zero, y1: 2, y2: 40, stroke: '#000'}, bar);
  let rows = '<tr><th>prototype</th><th>a</th><th>contribution</th><th>label, top ' +
             'snippets, signature (W p_i)</th></tr>';
  for (const p of [...t.protos].sort((a, b) => Math.abs(b.contrib) - Math.abs(a.contrib))) {
    const c = card(p.id);
    rows += `<tr class="proto-row" data-proto="${p.id}"><td><a data-card="${p.id}">#${p.id}` +
      `</a></td><td class="num">${p.act.toFixed(3)}</td><td class="num">${fmt(p.contrib)}` +
      `</td><td><div class="label">${esc(c.label)}</div>` +
      c.contexts.slice(0, 2).map(x => `<div>${snippetHtml(x)}</div>`).join('') +
      `<div class="muted">pushes: ${c.promoted.slice(0, 5).map(q => esc(JSON.stringify(
        q[0]))).join(' ')}</div></td></tr>`;
  }
  rows += `<tr class="proto-row" data-proto="residual"><td>residual</td><td></td>` +
          `<td class="num">${fmt(t.residual)}</td><td class="muted">&lt;W_y, r_t&gt;: the ` +
          'part no prototype explains</td></tr>';
  $('#ptable').innerHTML = rows;
  $('#attr').innerHTML = t.attributions.length ? '<h2>top attributed training sequences' +
    '</h2><p class="muted">by ' + esc(D.attribution_method) + '</p><ol>' + t.attributions.map(a => `<li><span class="muted">doc ${a.example_id}, ` +
    `score ${a.score.toExponential(2)}</span> <span class="snip">${inline(a.snippet)}</span>` +
    '</li>').join('') + '</ol>' : '<p class="muted">' + esc(D.attribution_note) + '</p>';
  det.querySelectorAll('a[data-card]').forEach(a =>
    a.addEventListener('click', () => showCard(+a.dataset.card)));
}

// --- the index: map, card list, card, plots ----------------------------------------------
function drawMap() {
  const svg = $('#map'), W = 400, H = 300, pad = 12;
  const xs = D.cards.map(c => c.xy[0]), ys = D.cards.map(c => c.xy[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = v => pad + (v - x0) / ((x1 - x0) || 1) * (W - 2 * pad);
  const sy = v => H - pad - (v - y0) / ((y1 - y0) || 1) * (H - 2 * pad);
  const umax = Math.log10(Math.max(...D.cards.map(c => c.usage), 1e-9) + 1e-6);
  const umin = Math.log10(1e-6);
  D.cards.forEach((c, i) => {
    const fill = $('#mapcolour').value === 'label' ? (c.terms.length ?
      `hsla(${strHue(c.terms[0])},70%,50%,0.85)` : '#ccc') :
      ramp((Math.log10(c.usage + 1e-6) - umin) / ((umax - umin) || 1));
    const pt = el('circle', {cx: sx(c.xy[0]).toFixed(1), cy: sy(c.xy[1]).toFixed(1), r: 3.2,
      class: 'pt', 'data-proto': i, fill, stroke: '#333', 'stroke-width': 0.3}, svg);
    el('title', {}, pt).textContent = `#${i} ${c.label} (usage ${(100 * c.usage).toFixed(2)}%)`;
    pt.addEventListener('click', () => showCard(i));
  });
}
function redrawMap() { $('#map').innerHTML = ''; drawMap(); }
function drawList() {
  const q = $('#search').value.trim().toLowerCase(), ul = $('#cardlist');
  ul.innerHTML = '';
  let n = 0;
  D.cards.forEach((c, i) => {
    const hay = (c.label + ' ' + c.contexts.map(x => x.before + x.trigger + x.after).join(' ')
                 ).toLowerCase();
    if (q && !hay.includes(q) && String(i) !== q) return;
    const li = document.createElement('li');
    li.dataset.proto = i;
    li.innerHTML = `#${i} <span class="label">${esc(c.label)}</span> <span class="muted">` +
                   `${(100 * c.usage).toFixed(2)}%</span>`;
    li.addEventListener('click', () => showCard(i));
    ul.appendChild(li);
    n++;
  });
  $('#nmatch').textContent = `${n} of ${D.cards.length}`;
}
function histogram(svg, counts, W, H) {
  const m = Math.max(...counts, 1), w = W / counts.length;
  counts.forEach((n, j) => el('rect', {x: (j * w).toFixed(1), y: (H - H * n / m).toFixed(1),
    width: Math.max(w - 1, 1).toFixed(1), height: (H * n / m).toFixed(1), fill: '#5c6bc0'},
    svg));
}
function showCard(i) {
  const c = card(i), box = $('#card');
  if (c.slim) {  // report_data(detail_cards=...) embedded only its label and usage
    box.innerHTML = `<h2 id="card-${i}">card #${i} <span class="label">${esc(c.label)}` +
      `</span></h2><div class="muted">usage ${(100 * c.usage).toFixed(3)}% of training ` +
      `tokens. This page embeds the details of ${D.detail_cards} of ${D.cards.length} ` +
      'cards (the sample\'s prototypes, their neighbours, the most used); the others are ' +
      'in cards.json (CardSet.load).</div>';
    document.querySelectorAll('circle.pt').forEach(p =>
      p.setAttribute('r', +p.dataset.proto === i ? 6 : 3.2));
    return;
  }
  box.innerHTML = `<h2 id="card-${i}">card #${i} <span class="label">${esc(c.label)}</span>` +
    `</h2><div class="muted">usage ${(100 * c.usage).toFixed(3)}% of training tokens; ` +
    `automatic label, ${esc(D.label_method)}</div><h2>top training contexts</h2>` +
    c.contexts.map(x => `<div>${snippetHtml(x)} <span class="muted">doc ${x.example_id}` +
    '</span></div>').join('') + '<h2>activation histogram</h2>' +
    '<svg id="hist" width="300" height="60" viewBox="0 0 300 60"></svg>' +
    `<h2>logit signature W p_${i}</h2><table><tr><td>promoted</td><td>` +
    c.promoted.map(q => `${esc(JSON.stringify(q[0]))} <span class="muted">${fmt(q[1])}` +
    '</span>').join(', ') + '</td></tr><tr><td>demoted</td><td>' +
    c.demoted.map(q => `${esc(JSON.stringify(q[0]))} <span class="muted">${fmt(q[1])}` +
    '</span>').join(', ') + '</td></tr></table><h2>nearest prototypes (cosine)</h2>' +
    c.neighbours.map((j, n) => `<a data-card="${j}">#${j}</a> <span class="muted">` +
    `${c.neighbour_cos[n].toFixed(3)}</span>`).join(' ');
  histogram($('#hist'), c.hist, 300, 60);
  box.querySelectorAll('a[data-card]').forEach(a =>
    a.addEventListener('click', () => showCard(+a.dataset.card)));
  document.querySelectorAll('circle.pt').forEach(p =>
    p.setAttribute('r', +p.dataset.proto === i ? 6 : 3.2));
}
function lineplot(svg, xs, ys, W, H, name) {
  const ok = ys.map((y, j) => [xs[j], y]).filter(p => p[1] !== null && isFinite(p[1]));
  if (!ok.length) return;
  const [x0, x1] = [Math.min(...ok.map(p => p[0])), Math.max(...ok.map(p => p[0]))];
  const [y0, y1] = [Math.min(...ok.map(p => p[1])), Math.max(...ok.map(p => p[1]))];
  const sx = v => 4 + (v - x0) / ((x1 - x0) || 1) * (W - 8);
  const sy = v => H - 14 - (v - y0) / ((y1 - y0) || 1) * (H - 28);
  el('polyline', {points: ok.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`)
    .join(' '), fill: 'none', stroke: '#00897b', 'stroke-width': 1.5}, svg);
  el('text', {x: 4, y: 10, 'font-size': 10}, svg).textContent =
    `${name}: ${ok[ok.length - 1][1].toPrecision(4)} (step ${ok[ok.length - 1][0]})`;
}
function drawPlots() {
  const box = $('#plots');
  const m = D.metrics;
  for (const name of Object.keys(m.series)) {
    const svg = el('svg', {width: 190, height: 70, viewBox: '0 0 190 70', class: 'plot'}, box);
    lineplot(svg, m.steps, m.series[name], 190, 70, name);
  }
  if (!Object.keys(m.series).length)
    box.insertAdjacentHTML('beforeend', '<p class="muted">no metrics.jsonl</p>');
  const svg = el('svg', {width: 380, height: 70, viewBox: '0 0 380 70'}, $('#usage'));
  histogram(svg, D.usage_hist.counts, 380, 56);
  el('text', {x: 2, y: 68, 'font-size': 10}, svg).textContent =
    `log10 usage from ${D.usage_hist.edges[0].toFixed(1)} to ` +
    `${D.usage_hist.edges[D.usage_hist.edges.length - 1].toFixed(1)}; ` +
    `${D.usage_hist.never} never active`;
}
$('#colour').addEventListener('change', colourTokens);
$('#residonly').addEventListener('change', filterTokens);
$('#mapcolour').addEventListener('change', redrawMap);
$('#search').addEventListener('input', drawList);
drawText(); drawMap(); drawList(); drawPlots();
if (D.tokens.length) {  // open on the first generated token and its top prototype's card
  const first = Math.max(0, D.tokens.findIndex(t => t.generated));
  showToken(first);
  if (topProto(D.tokens[first])) showCard(topProto(D.tokens[first]).id);
}
"""

BODY = """
<header><h1>{title}</h1><div>{subtitle}</div><div class="faith">{faith}</div></header>
<main>
<div>
 <section><h2>prompt and generation</h2>
  <div class="muted">colour by <select id="colour"><option value="top">top prototype
  </option><option value="share">prototype-path share</option></select>
  <label><input type="checkbox" id="hover"> follow hover</label>
  <label><input type="checkbox" id="residonly"> only tokens the residual decided
  ({resid} of {ntok}, dashed red)</label>;
  click a token for its decomposition (prompt tokens underlined)</div>
  <div id="text"></div></section>
 <section id="detail"></section>
</div>
<div>
 <section><h2>prototype map ({method})</h2>
  <div class="muted">colour by <select id="mapcolour"><option value="usage">usage</option>
  <option value="label">label (top term)</option></select>; click a point for its card</div>
  <svg id="map" width="400" height="300" viewBox="0 0 400 300"></svg></section>
 <section><h2>cards</h2><input id="search" placeholder="search labels and contexts"
  size="34"> <span id="nmatch" class="muted"></span><ul id="cardlist"></ul></section>
 <section id="card"><p class="muted">click a prototype for its card</p></section>
 <section><h2>usage over prototypes</h2><div id="usage"></div>
  <h2>grounding and faithfulness over training (val)</h2><div id="plots"></div></section>
</div>
</main>
"""


def _json_for_script(obj) -> str:
  """JSON safe inside <script>: no '</' can end the element early."""
  return json.dumps(obj, ensure_ascii=False, allow_nan=False).replace("</", "<\\/")


def render(data: dict) -> str:
  """The whole page for report_data's dict."""
  body = BODY.format(title=html.escape(data["title"]), subtitle=html.escape(data["subtitle"]),
                     faith=html.escape(data["faithfulness_line"]),
                     method=html.escape(data["map_method"]),
                     resid=int(data["residual_decided"]), ntok=len(data["tokens"]))
  return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
          f"<title>{html.escape(data['title'])}</title><style>{CSS}</style></head><body>"
          f"{body}<script type=\"application/json\" id=\"data\">{_json_for_script(data)}"
          f"</script><script>{JS}</script></body></html>\n")
