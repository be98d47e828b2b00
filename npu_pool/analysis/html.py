"""The analysis as one self-contained HTML page: inline SVG, CSS and a little JS, nothing fetched.

The page shows the memory timeline (live bytes and each policy's reserved bytes
over the events, marked stages shaded, the peak marked), the breakdown at the peak,
the per-policy fragmentation table and sortable, filterable tables of sites,
layers, ranks and (when given) the estimate comparison. Its script sorts and
filters tables, shows the values under the mouse on the timeline, and finally
appends ``<div id="report-ready">``; an uncaught error appends
``<div id="report-error">`` instead. Opened with ``#selftest`` the script also
sorts and filters the sites table and records the outcome in
``report-ready``'s ``data-selftest`` (``pass`` or what failed).
"""
from __future__ import annotations

import html as _html
import json
import math
from typing import Any, Sequence

from .breakdown import GROUP_LABELS, GROUPS, TraceProfile
from .report import Analysis, TraceAnalysis, imbalance, rank_groups
from ..trace.files import repairs_said
from ..units import fmt_bytes, fmt_share, printable

__all__ = ["render_html", "timeline_svg", "downsample"]

GROUP_COLORS = {"weights": "#4e79a7", "gradients": "#f28e2c", "optimizer_states": "#59a14f",
                "activations": "#e15759", "temporaries": "#76b7b2", "other": "#edc949", "unknown": "#bab0ab"}
POLICY_COLORS = {"torch": "#d62728", "expandable": "#9467bd", "npu_pool": "#1f9e4a"}
POLICY_DASHES = {"torch": "", "expandable": "6 3", "npu_pool": "2 2"}  # overlapping lines stay visible
STAGE_COLORS = {"setup": "#e9e9e9", "forward": "#dcebf7", "backward": "#fde6d2", "optimizer": "#e0f1dc",
                "eval": "#ece0f3"}
_W, _H, _L, _R, _T, _B = 1000, 340, 78, 16, 14, 40  # timeline size and margins
_MAX_POINTS = 1200
_MAX_SITE_ROWS = 300


def _esc(s: Any) -> str:
    """``s`` as HTML text: :func:`printable` (control characters, bidirectional overrides and
    isolates as escapes: a frame name cannot reorder what a reader sees), then escaped."""
    return _html.escape(printable(str(s)), quote=True)


def downsample(values: Sequence[int], n: int, buckets: int = _MAX_POINTS) -> list[tuple[int, int]]:
    """(first event, highest value) per bucket of ``values[:n]``; every event when ``n <= buckets``."""
    if n <= buckets:
        return [(i, int(values[i])) for i in range(n)]
    out = []
    for k in range(buckets):
        lo, hi = k * n // buckets, (k + 1) * n // buckets
        out.append((lo, int(max(values[lo:hi]))))
    return out


def _unit(v: float) -> tuple[float, str]:
    for div, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if v >= div:
            return float(div), name
    return 1.0, "B"


def _ticks(top: float, n: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top`` (in the same unit)."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [k * step for k in range(int(math.ceil(top / step)) + 1)]


def timeline_svg(t: TraceAnalysis) -> tuple[str, dict[str, Any]]:
    """The timeline SVG of one trace and the data its tooltip script reads."""
    p = t.profile
    n = max(1, p.events)
    live = downsample(p.curve, p.events)
    series = {pol: downsample(tl.reserved, tl.fail_index if not tl.ok else p.events)
              for pol, tl in t.timelines.items()}
    top = max([p.peak_live] + [max((v for _, v in s), default=0) for s in series.values()] + [1])
    div, unit = _unit(top)
    ticks = _ticks(top / div)
    ymax = ticks[-1] * div
    pw, ph = _W - _L - _R, _H - _T - _B

    def x(i: float) -> float:
        return _L + pw * i / max(1, n - 1)

    def y(v: float) -> float:
        return _T + ph * (1 - v / ymax)

    parts = [f'<svg id="timeline" class="timeline" viewBox="0 0 {_W} {_H}" width="100%" role="img" '
             f'aria-label="memory timeline">']
    for s in p.spans:
        if s.stage in STAGE_COLORS:
            parts.append(f'<rect class="stage stage-{s.stage}" x="{x(s.start):.1f}" y="{_T}" '
                         f'width="{max(0.5, x(s.end - 1) - x(s.start)):.1f}" height="{ph}" '
                         f'fill="{STAGE_COLORS[s.stage]}"><title>{_esc(s.stage)}'
                         f'{"" if s.iteration is None else f" (iteration {s.iteration})"}: events {s.start}-{s.end - 1}'
                         f'</title></rect>')
    for v in ticks:
        yy = y(v * div)
        parts.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>'
                     f'<text x="{_L - 6}" y="{yy + 4:.1f}" class="tick" text-anchor="end">{v:g} {unit}</text>')
    for k in range(6):
        i = (n - 1) * k / 5
        anchor = "start" if k == 0 else "end" if k == 5 else "middle"
        parts.append(f'<text x="{x(i):.1f}" y="{_H - _B + 16}" class="tick" text-anchor="{anchor}">{int(i)}</text>')
    parts.append(f'<text x="{_L + pw / 2}" y="{_H - 6}" class="axis" text-anchor="middle">event</text>')
    if live:
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in live)
        parts.append(f'<polygon class="live-area" points="{x(live[0][0]):.1f},{y(0):.1f} {pts} '
                     f'{x(live[-1][0]):.1f},{y(0):.1f}" fill="#4e79a7" fill-opacity="0.25"/>')
        parts.append(f'<polyline id="line-live" class="series" points="{pts}" fill="none" stroke="#2b5d8c" '
                     f'stroke-width="1.4"/>')
    # widest first: where two policies reserve the same bytes, the later, thinner line runs
    # inside the earlier one and both stay visible
    for k, (pol, s) in enumerate(series.items()):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in s)
        width = 1.5 + 2.0 * (len(series) - 1 - k)
        parts.append(f'<polyline id="line-{_esc(pol)}" class="series" points="{pts}" fill="none" '
                     f'stroke="{POLICY_COLORS.get(pol, "#555")}" stroke-width="{width:.1f}" stroke-opacity="0.85" '
                     f'stroke-dasharray="{POLICY_DASHES.get(pol, "4 2")}"/>')
    if p.peak_index >= 0:
        px = x(p.peak_index)
        parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{_T}" y2="{_T + ph}" class="peak"/>'
                     f'<circle cx="{px:.1f}" cy="{y(p.peak_live):.1f}" r="3.5" fill="#2b5d8c"/>'
                     f'<text x="{min(px + 5, _W - 160):.1f}" y="{_T + 12}" class="peak-label">peak live '
                     f'{_esc(fmt_bytes(p.peak_live))}</text>')
    parts.append(f'<line id="cursor" x1="0" x2="0" y1="{_T}" y2="{_T + ph}" class="cursor" visibility="hidden"/>')
    parts.append(f'<rect x="{_L}" y="{_T}" width="{pw}" height="{ph}" fill="none" stroke="#999"/></svg>')
    data = {"n": n, "left": _L, "width": pw, "viewWidth": _W, "live": [v for _, v in live],
            "liveIdx": [i for i, _ in live], "reserved": {pol: [v for _, v in s] for pol, s in series.items()},
            "reservedIdx": {pol: [i for i, _ in s] for pol, s in series.items()}}
    return "".join(parts), data


def _legend(t: TraceAnalysis) -> str:
    items = ['<span><i style="background:#2b5d8c"></i>live (requested, not freed)</span>']
    seen: dict[bytes, str] = {}
    for pol, tl in t.timelines.items():
        same = seen.setdefault(tl.reserved.tobytes(), pol)
        note = f" (the same as {_esc(same)} throughout)" if same != pol else ""
        items.append(f'<span><i style="background:{POLICY_COLORS.get(pol, "#555")}"></i>reserved: {_esc(pol)}'
                     f'{note}</span>')
    stages = {s.stage for s in t.profile.spans}
    items += [f'<span><i class="box" style="background:{c}"></i>{st}</span>' for st, c in STAGE_COLORS.items()
              if st in stages]
    return '<div class="legend">' + "".join(items) + "</div>"


def _breakdown_svg(p: TraceProfile) -> str:
    total = max(1, p.peak_live)
    xpos, parts = 0.0, ['<svg class="bar" viewBox="0 0 1000 36" width="100%" role="img" aria-label="breakdown">']
    for g in GROUPS:
        v = p.at_peak[g]
        if v <= 0:
            continue
        w = 1000 * v / total
        parts.append(f'<rect class="seg seg-{g}" x="{xpos:.2f}" y="0" width="{w:.2f}" height="36" '
                     f'fill="{GROUP_COLORS[g]}"><title>{GROUP_LABELS[g]}: {_esc(fmt_bytes(v))} '
                     f'({fmt_share(v, total)})</title></rect>')
        if w > 70:
            parts.append(f'<text x="{xpos + 6:.1f}" y="23" class="bar-label">{GROUP_LABELS[g]} '
                         f'{fmt_share(v, total)}</text>')
        xpos += w
    keys = "".join(f'<span><i class="box" style="background:{GROUP_COLORS[g]}"></i>{GROUP_LABELS[g]} '
                   f'{_esc(fmt_bytes(p.at_peak[g]))} ({fmt_share(p.at_peak[g], total)})</span>'
                   for g in GROUPS if p.at_peak[g] > 0)
    return "".join(parts) + f'</svg><div class="legend bar-keys">{keys}</div>'  # every segment named, narrow or not


def _td(text: str, value: float | None = None, cls: str = "") -> str:
    v = f' data-v="{value}"' if value is not None else ""
    c = f' class="{cls}"' if cls else ""
    return f"<td{v}{c}>{_esc(text)}</td>"


def _table(tid: str, head: list[str], rows: list[str], filt: bool = False, numeric_from: int = 1) -> str:
    ths = "".join(f'<th data-col="{k}" class="{"num" if k >= numeric_from else ""}">{_esc(h)}</th>'
                  for k, h in enumerate(head))
    box = (f'<div class="tools"><input type="search" class="filter" data-table="{tid}" placeholder="filter rows ..." '
           f'aria-label="filter {tid}"> <span class="count" id="{tid}-count">{len(rows)} rows</span></div>'
           if filt else "")
    return (f'{box}<table id="{tid}" class="sortable"><thead><tr>{ths}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _policy_rows(t: TraceAnalysis) -> list[str]:
    rows = []
    for f in t.policies:
        rows.append("<tr>" + _td(f.policy) + _td(fmt_bytes(f.peak_reserved), f.peak_reserved)
                    + _td(f"{100 * f.utilization:.1f}%", f.utilization) + _td(fmt_bytes(f.waste), f.waste)
                    + _td(str(f.device_mallocs), f.device_mallocs)
                    + _td("-" if f.min_capacity is None else fmt_bytes(f.min_capacity), f.min_capacity or 0)
                    + _td("-" if f.peak_reserved_index is None else str(f.peak_reserved_index),
                          -1 if f.peak_reserved_index is None else f.peak_reserved_index) + "</tr>")
    return rows


def _trace_section(t: TraceAnalysis, estimate_rows: list | None) -> str:
    p = t.profile
    svg, data = timeline_svg(t)
    cards = [("peak live", fmt_bytes(p.peak_live), f"event {p.peak_index} of {p.events}"),
             ("phase of the peak", p.peak_phase.describe(), f"categories: {p.category_source}")]
    for f in t.policies:
        cards.append((f"peak reserved: {f.policy}", fmt_bytes(f.peak_reserved),
                      f"utilization {100 * f.utilization:.1f}%, waste {fmt_bytes(f.waste)}"))
    card_html = "".join(f'<div class="card"><div class="k">{_esc(k)}</div><div class="v">{_esc(v)}</div>'
                        f'<div class="s">{_esc(s)}</div></div>' for k, v, s in cards)
    out = [f'<section class="trace" data-trace="{_esc(t.name)}"><h2>{_esc(t.name)}</h2>',
           f'<div class="cards">{card_html}</div>', "<h3>Memory timeline</h3>",
           f'<div class="chart">{svg}<div id="tip" class="tip"></div></div>', _legend(t),
           f'<script type="application/json" id="timeline-data">{json.dumps(data)}</script>',
           "<h3>Live bytes at the peak by category</h3>", _breakdown_svg(p)]
    if t.repairs:
        out.insert(2, f'<p class="note">{_esc(repairs_said(t.repairs))}.</p>')
    rows = ["<tr>" + _td(GROUP_LABELS[g]) + _td(fmt_bytes(p.at_peak[g]), p.at_peak[g])
            + _td(fmt_share(p.at_peak[g], p.peak_live), p.at_peak[g] / max(1, p.peak_live))
            + _td(fmt_bytes(p.group_max[g]), p.group_max[g]) + "</tr>"
            for g in GROUPS if p.at_peak[g] or p.group_max[g]]
    out.append(_table("breakdown", ["category", "at the peak", "share", "highest anywhere"], rows))
    out += ["<h3>Fragmentation per policy</h3>",
            _table("policies", ["policy", "peak reserved", "utilization", "waste", "device mallocs", "min capacity",
                                "peak reserved at event"], _policy_rows(t)),
            '<p class="note">utilization = peak live / peak reserved; waste = peak reserved - peak live.</p>']
    if estimate_rows:
        rows = []
        for r in estimate_rows:
            rows.append("<tr>" + _td(r.figure) + _td("-" if r.estimated is None else fmt_bytes(r.estimated),
                                                     r.estimated or 0)
                        + _td("-" if r.measured is None else fmt_bytes(r.measured), r.measured or 0)
                        + _td("-" if r.diff is None else fmt_bytes(r.diff), r.diff or 0)
                        + _td("-" if r.ratio is None else f"{r.ratio:.3f}", r.ratio or 0) + "</tr>")
        out += ["<h3>Static estimate vs this trace</h3>",
                _table("estimate", ["figure", "estimated", "measured", "measured - estimated", "ratio"], rows)]
    rows = ["<tr>" + _td(s.name) + _td(fmt_bytes(s.live_at_peak), s.live_at_peak)
            + _td(fmt_bytes(s.total_bytes), s.total_bytes) + _td(str(s.allocs), s.allocs)
            + _td(fmt_bytes(s.largest), s.largest) + "</tr>" for s in p.sites[:_MAX_SITE_ROWS]]
    more = f" (top {_MAX_SITE_ROWS} of {len(p.sites)})" if len(p.sites) > _MAX_SITE_ROWS else ""
    out += [f"<h3>Allocation sites{more}</h3>",
            _table("sites", ["site", "live at peak", "allocated in total", "allocations", "largest"], rows, True)]
    if p.layers:
        rows = ["<tr>" + _td(str(L.layer), L.layer) + _td(str(L.passes), L.passes)
                + _td(fmt_bytes(L.added_mean), L.added_mean) + _td(fmt_bytes(L.added_max), L.added_max)
                + _td(fmt_bytes(L.transient_max), L.transient_max) + "</tr>" for L in p.layers]
        out += ["<h3>Forward: live bytes added per layer</h3>",
                _table("layers", ["layer", "passes", "added (mean)", "added (max)", "transient high"], rows,
                       numeric_from=0),
                '<p class="note">added = live at layer exit - live at enter; transient high = highest live '
                "inside the layer - live at enter.</p>"]
    out.append("</section>")
    return "".join(out)


def _ranks_section(a: Analysis) -> str:
    pols = [f.policy for f in a.traces[0].policies]
    groups = rank_groups(a)
    top = max(t.profile.peak_live for t in a.traces) or 1
    bar_h, gap = 18, 4
    svg = [f'<svg class="ranks" viewBox="0 0 1000 {len(a.traces) * (bar_h + gap)}" width="100%" role="img" '
           f'aria-label="peak live per rank">']
    for k, t in enumerate(a.traces):
        w = 760 * t.profile.peak_live / top
        yy = k * (bar_h + gap)
        hot = ' class="hot"' if t.profile.peak_live == top else ""
        svg.append(f'<text x="0" y="{yy + 13}" class="tick">{_esc(t.name[:28])}</text>'
                   f'<rect{hot} x="200" y="{yy}" width="{w:.1f}" height="{bar_h}" fill="#4e79a7"/>'
                   f'<text x="{205 + w:.1f}" y="{yy + 13}" class="tick">{_esc(fmt_bytes(t.profile.peak_live))}</text>')
    svg.append("</svg>")
    rows = []
    for t in a.traces:
        p = t.profile
        rows.append("<tr>" + _td(t.name) + _td(fmt_bytes(p.peak_live), p.peak_live)
                    + "".join(_td(fmt_bytes(f.peak_reserved), f.peak_reserved) for f in t.policies)
                    + "".join(_td(fmt_bytes(p.at_peak[g]), p.at_peak[g]) for g in groups)
                    + _td(p.peak_phase.describe()) + "</tr>")
    head = ["rank", "peak live", *[f"reserved {p}" for p in pols], *[GROUP_LABELS[g] for g in groups],
            "phase of the peak"]
    imb = ["<tr>" + _td(r["figure"]) + _td(fmt_bytes(r["max_bytes"]), r["max_bytes"]) + _td(r["max_rank"])
           + _td(fmt_bytes(r["min_bytes"]), r["min_bytes"]) + _td(r["min_rank"])
           + _td(f"{r['max_over_mean']:.3f}", r["max_over_mean"]) + _td(fmt_bytes(r["spread_bytes"]), r["spread_bytes"])
           + "</tr>" for r in imbalance(a)]
    return ('<section class="ranks"><h2>Ranks</h2>' + "".join(svg)
            + _table("ranks", head, rows, True) + "<h3>Imbalance</h3>"
            + _table("imbalance", ["figure", "max", "on", "min", "on", "max / mean", "max - min"], imb)
            + f'<p class="note">Details below: {_esc(a.worst().name)}, the rank with the highest peak.</p></section>')


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1100px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:18px;margin:26px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:20px 0 6px}.sub{color:#666;margin:0 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:#fff;border:1px solid #e2e2e2;border-radius:8px;
padding:8px 12px;min-width:170px;flex:1}.card .k{color:#666;font-size:12px}.card .v{font-size:18px;font-weight:600}
.card .s{color:#666;font-size:12px}.chart{position:relative;background:#fff;border:1px solid #e2e2e2;border-radius:8px}
.grid{stroke:#eee}.tick{font-size:11px;fill:#555}.axis{font-size:12px;fill:#333}.peak{stroke:#2b5d8c;stroke-dasharray:4 3}
.peak-label{font-size:12px;fill:#2b5d8c;font-weight:600}.cursor{stroke:#333;stroke-width:.6}
.tip{position:absolute;top:8px;right:12px;background:rgba(255,255,255,.95);border:1px solid #ccc;border-radius:6px;
padding:4px 8px;font-size:12px;display:none;pointer-events:none;white-space:pre}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:6px 0;font-size:12px;color:#444}
.legend i{display:inline-block;width:14px;height:3px;margin-right:5px;vertical-align:middle}
.legend i.box{height:10px;border:1px solid #ccc}.bar{border-radius:6px;overflow:hidden}.bar-label{font-size:13px;fill:#fff}
table{border-collapse:collapse;width:100%;background:#fff;margin:4px 0 6px;font-size:13px}
th,td{border-bottom:1px solid #eee;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;user-select:none;position:sticky;top:0}
th.num,td[data-v]{text-align:right;white-space:nowrap}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
tbody tr:nth-child(even){background:#fbfbfb}td:first-child{word-break:break-all}
.tools{margin:4px 0}.filter{padding:4px 8px;width:320px;border:1px solid #ccc;border-radius:6px}.count{color:#666;font-size:12px}
.note{color:#666;font-size:12px;margin:2px 0 8px}.ranks .hot{fill:#e15759}footer{color:#888;font-size:12px;margin-top:30px}
"""

_JS = r"""
(function(){
  function fail(msg){var d=document.createElement('div');d.id='report-error';d.textContent=String(msg);document.body.appendChild(d);}
  window.addEventListener('error',function(e){fail(e.message);});
  function cellValue(td){var v=td.getAttribute('data-v');return v===null?td.textContent.toLowerCase():parseFloat(v);}
  function sortTable(table,col,dir){
    var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){var x=cellValue(a.cells[col]),y=cellValue(b.cells[col]);
      return (x<y?-1:x>y?1:0)*(dir==='ascending'?1:-1);});
    rows.forEach(function(r){body.appendChild(r);});
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,k){
      if(k===col)th.setAttribute('aria-sort',dir);else th.removeAttribute('aria-sort');});
  }
  function filterTable(table,text){
    var q=text.toLowerCase(),shown=0,rows=table.tBodies[0].rows;
    for(var i=0;i<rows.length;i++){var ok=rows[i].textContent.toLowerCase().indexOf(q)>=0;
      rows[i].style.display=ok?'':'none';if(ok)shown++;}
    var c=document.getElementById(table.id+'-count');if(c)c.textContent=shown+' of '+rows.length+' rows';
    return shown;
  }
  Array.prototype.forEach.call(document.querySelectorAll('table.sortable'),function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,k){
      th.addEventListener('click',function(){
        var dir=th.getAttribute('aria-sort')==='descending'?'ascending':'descending';sortTable(table,k,dir);});
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll('input.filter'),function(inp){
    inp.addEventListener('input',function(){filterTable(document.getElementById(inp.getAttribute('data-table')),inp.value);});
  });
  function fmt(b){var u=['B','KiB','MiB','GiB','TiB'],k=0;while(Math.abs(b)>=1024&&k<4){b/=1024;k++;}
    return (k?b.toFixed(2):b.toFixed(0))+' '+u[k];}
  function lookup(idx,vals,i){if(!idx.length)return 0;var lo=0,hi=idx.length-1;while(lo<hi){var m=(lo+hi+1)>>1;if(idx[m]<=i)lo=m;else hi=m-1;}
    return vals[lo];}
  var dataEl=document.getElementById('timeline-data'),svg=document.getElementById('timeline'),
      tip=document.getElementById('tip'),cursor=document.getElementById('cursor');
  if(dataEl&&svg){
    var D=JSON.parse(dataEl.textContent);
    svg.addEventListener('mousemove',function(ev){
      var r=svg.getBoundingClientRect(),vx=(ev.clientX-r.left)*D.viewWidth/r.width;
      var f=(vx-D.left)/D.width;if(f<0||f>1){tip.style.display='none';cursor.setAttribute('visibility','hidden');return;}
      var i=Math.round(f*(D.n-1)),lines=['event '+i,'live '+fmt(lookup(D.liveIdx,D.live,i))];
      for(var p in D.reserved)lines.push('reserved '+p+' '+fmt(lookup(D.reservedIdx[p],D.reserved[p],i)));
      tip.textContent=lines.join('\n');tip.style.display='block';
      cursor.setAttribute('x1',vx);cursor.setAttribute('x2',vx);cursor.setAttribute('visibility','visible');
    });
    svg.addEventListener('mouseleave',function(){tip.style.display='none';cursor.setAttribute('visibility','hidden');});
  }
  var result='not run';
  if(location.hash==='#selftest'){
    var t=document.getElementById('sites'),problems=[];
    if(!t||t.tBodies[0].rows.length<2){problems.push('sites table too small');}
    else{
      sortTable(t,1,'ascending');var a=Array.prototype.map.call(t.tBodies[0].rows,function(r){return cellValue(r.cells[1]);});
      for(var i=1;i<a.length;i++)if(a[i-1]>a[i]){problems.push('ascending sort');break;}
      sortTable(t,1,'descending');a=Array.prototype.map.call(t.tBodies[0].rows,function(r){return cellValue(r.cells[1]);});
      for(i=1;i<a.length;i++)if(a[i-1]<a[i]){problems.push('descending sort');break;}
      var q=t.tBodies[0].rows[0].cells[0].textContent,n=filterTable(t,q),bad=0;
      Array.prototype.forEach.call(t.tBodies[0].rows,function(r){
        if(r.style.display!=='none'&&r.textContent.indexOf(q)<0)bad++;});
      if(n<1||bad)problems.push('filter');
      var c=document.getElementById('sites-count');if(!c||c.textContent.indexOf(' of ')<0)problems.push('count');
      filterTable(t,'');
      sortTable(t,2,'ascending');  /* left so: the test reads this order from the DOM and checks it itself */
    }
    result=problems.length?problems.join(', '):'pass';
  }
  var ok=document.createElement('div');ok.id='report-ready';ok.setAttribute('data-selftest',result);
  ok.setAttribute('data-tables',String(document.querySelectorAll('table.sortable').length));
  ok.hidden=true;document.body.appendChild(ok);
})();
"""


def render_html(a: Analysis, *, estimate_rows: list | None = None, title: str | None = None) -> str:
    """The whole page for ``a`` (its traces should be analyzed with ``curves=True`` for reserved lines)."""
    main = a.worst()
    title = title or f"Memory analysis: {a.source}"
    body = [f"<h1>{_esc(title)}</h1>",
            f'<p class="sub">{len(a.traces)} trace{"s" if a.ranks else ""}; policies: '
            f'{_esc(", ".join(f.policy for f in main.policies))}. Live = requested bytes not yet freed; '
            "reserved = what each allocator policy holds from the device when the trace is replayed.</p>"]
    if a.ranks:
        body.append(_ranks_section(a))
    body.append(_trace_section(main, estimate_rows))
    body.append('<footer>npu_pool analyze &middot; self-contained page (no network)</footer>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{_esc(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(body)}</main><script>{_JS}</script></body></html>\n")
