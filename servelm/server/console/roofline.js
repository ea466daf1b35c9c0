// The roofline chart, drawn as SVG from /v1/stats' "roofline" object: the machine's
// bandwidth roof (FLOP/s = bandwidth x intensity) and compute roof (its matmul peak), meeting
// at the ridge, and where the decode and prefill steps sit (achieved FLOP/s at their
// arithmetic intensity). A point left of the ridge is memory-bound, right of it
// compute-bound; its distance below the roof is what the phase leaves on the table.

const NS = "http://www.w3.org/2000/svg";
const H = 330, LEFT = 60, RIGHT = 24, TOP = 16, BOTTOM = 42;
// The drawing's width in viewBox units: the chart's CSS width within these bounds, so its
// labels keep their size from a phone's width up, and only a very wide chart scales them up.
const MIN_W = 320, MAX_W = 760;
const CHAR_W = 6.2;  // a label character's width, about, at the chart's 11 px
const PREFIXES = [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];

/** `v` with an SI prefix, to three significant digits: si(2.54e10, "B/s") = "25.4 GB/s". */
export function si(v, unit = "", digits = 3) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const [scale, p] = PREFIXES.find(([scale]) => Math.abs(v) >= scale) || [1, ""];
  return `${Number((v / scale).toPrecision(digits))} ${p}${unit}`.trim();
}

function node(parent, tag, attrs = {}, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  parent.append(e);
  return e;
}

const decade = (v, up) => (up ? Math.ceil : Math.floor)(Math.log10(v));

/** The point to draw for a phase: the last few seconds' steps, else the totals since start. */
export function phasePoint(phase) {
  if (!phase) return null;
  if (phase.current) return { ...phase.current, stale: false };
  if (phase.total) return { ...phase.total, stale: true };
  return null;
}

/** Redraw `svg` for `roof` (stats.roofline). */
export function drawRoofline(svg, roof) {
  svg.replaceChildren();
  const W = Math.round(Math.min(MAX_W, Math.max(MIN_W, svg.clientWidth || 640)));
  const box = `0 0 ${W} ${H}`;
  if (svg.getAttribute("viewBox") !== box) svg.setAttribute("viewBox", box);
  const hw = roof.machine;
  const points = ["decode", "prefill"]
    .map((name) => ({ name, p: phasePoint(roof[name]) }))
    .filter(({ p }) => p && p.flops > 0 && p.intensity > 0);
  if (!hw && !points.length) {
    node(svg, "text", { x: W / 2, y: H / 2, class: "empty" }, "no steps yet, and the machine is not measured");
    return;
  }
  // Decades spanning the roofs' corner and every point, with room around them.
  const xs = points.map(({ p }) => p.intensity), ys = points.map(({ p }) => p.flops);
  if (hw) xs.push(hw.ridge / 50, hw.ridge * 500);
  const x0 = decade(Math.min(...xs.map((x) => x / 2)), false);
  const x1 = decade(Math.max(...xs.map((x) => x * 2)), true);
  if (hw) ys.push(hw.bandwidth * 10 ** x0, Math.max(hw.flops, hw.int8_ops || 0) * 3);
  const y1 = decade(Math.max(...ys.map((y) => y * 1.5)), true);
  const y0 = Math.max(decade(Math.min(...ys.map((y) => y / 2)), false), y1 - 6);
  const sx = (v) => LEFT + ((Math.log10(v) - x0) / (x1 - x0)) * (W - LEFT - RIGHT);
  const sy = (v) => TOP + (1 - (Math.log10(v) - y0) / (y1 - y0)) * (H - TOP - BOTTOM);

  const grid = node(svg, "g", { class: "grid" });
  for (let e = x0; e <= x1; e++) {
    node(grid, "line", { x1: sx(10 ** e), x2: sx(10 ** e), y1: TOP, y2: H - BOTTOM });
    node(svg, "text", { x: sx(10 ** e), y: H - BOTTOM + 15, class: "tick x" }, si(10 ** e));
  }
  for (let e = y0; e <= y1; e++) {
    node(grid, "line", { x1: LEFT, x2: W - RIGHT, y1: sy(10 ** e), y2: sy(10 ** e) });
    node(svg, "text", { x: LEFT - 6, y: sy(10 ** e) + 4, class: "tick y" }, si(10 ** e));
  }
  node(svg, "text", { x: (LEFT + W - RIGHT) / 2, y: H - 6, class: "axis" },
    "arithmetic intensity (FLOP per byte read)");
  node(svg, "text", { x: 14, y: (TOP + H - BOTTOM) / 2, class: "axis",
    transform: `rotate(-90 14 ${(TOP + H - BOTTOM) / 2})` }, "FLOP/s");

  if (hw) {
    // The bandwidth roof starts where it enters the chart (its bottom edge or left side).
    const xStart = Math.max(10 ** x0, 10 ** y0 / hw.bandwidth);
    const ridge = hw.ridge;
    node(svg, "polyline", { class: "roof", points: [
      [sx(xStart), sy(hw.bandwidth * xStart)], [sx(ridge), sy(hw.flops)], [sx(10 ** x1), sy(hw.flops)],
    ].map((p) => p.join(",")).join(" ") });
    node(svg, "line", { class: "ridge", x1: sx(ridge), x2: sx(ridge), y1: sy(hw.flops), y2: H - BOTTOM });
    node(svg, "text", { x: sx(ridge) + 4, y: H - BOTTOM - 6, class: "ridge-label" },
      `ridge ${si(ridge)} FLOP/B`);
    node(svg, "text", { x: sx(ridge) - 8, y: H - BOTTOM - 22, class: "region left" }, "memory-bound ←");
    node(svg, "text", { x: sx(ridge) + 8, y: H - BOTTOM - 22, class: "region right" }, "→ compute-bound");
    // Above the compute roof at its right end; under it where a narrow chart would bring
    // it back over the ridge (and the bandwidth roof's label).
    const computeLabel = `compute roof ${si(hw.flops, "FLOP/s")}`;
    const above = W - RIGHT - 4 - computeLabel.length * CHAR_W > sx(ridge) + 8;
    node(svg, "text", { x: W - RIGHT - 4, y: sy(hw.flops) + (above ? -6 : 16),
      class: "roof-label end" }, computeLabel);
    if (hw.int8_ops > hw.flops) {
      // int8 activations' roof (q8act layers): the same bandwidth slope, a higher ceiling.
      const r8 = hw.int8_ops / hw.bandwidth;
      node(svg, "polyline", { class: "roof int8", "data-testid": "int8-roof", points: [
        [sx(ridge), sy(hw.flops)], [sx(r8), sy(hw.int8_ops)], [sx(10 ** x1), sy(hw.int8_ops)],
      ].map((p) => p.join(",")).join(" ") });
      node(svg, "text", { x: W - RIGHT - 4, y: sy(hw.int8_ops) - 6, class: "roof-label end" },
        `int8 roof ${si(hw.int8_ops, "OP/s")}`);
    }
    // The bandwidth label runs along its roof, at the slope's on-screen angle, centred on
    // the slope's middle decade.
    const xm = Math.sqrt(xStart * ridge);
    const angle = (Math.atan2(sy(hw.bandwidth * ridge) - sy(hw.bandwidth * xStart),
      sx(ridge) - sx(xStart)) * 180) / Math.PI;
    node(svg, "text", { x: sx(xm), y: sy(hw.bandwidth * xm) - 6, class: "roof-label mid",
      transform: `rotate(${angle} ${sx(xm)} ${sy(hw.bandwidth * xm) - 6})` },
    `bandwidth roof ${si(hw.bandwidth, "B/s")}`);
  }

  const placed = [];  // the point labels' boxes so far: [left, right, baseline]
  for (const { name, p } of points) {
    const cx = sx(p.intensity), cy = sy(p.flops);
    const g = node(svg, "g", { class: `pt ${name}${p.stale ? " stale" : ""}`, "data-phase": name });
    if (hw) {  // how far below its roof the phase runs
      const attainable = Math.min(hw.flops, hw.bandwidth * p.intensity);
      node(g, "line", { class: "headroom", x1: cx, x2: cx, y1: cy, y2: sy(attainable) });
    }
    node(g, "circle", { cx, cy, r: 6 });
    // The bound as well where the chart is wide enough for it (the table below says it too).
    const label = `${name}${p.bound && W >= 480 ? ` · ${p.bound}-bound` : ""}`;
    // Beside the point if it fits, else under it (the roof is always above a point); moved
    // down past any label already there.
    const width = label.length * 7;
    const right = cx + 10 + width < W - RIGHT;
    const [x0, x1] = right ? [cx + 10, cx + 10 + width] : [cx + 8 - width, cx + 8];
    let y = right ? cy + 4 : cy + 20;
    while (placed.some(([a, b, v]) => a < x1 && x0 < b && Math.abs(v - y) < 15)) y += 16;
    placed.push([x0, x1, y]);
    node(g, "text", { x: right ? x0 : x1, y, class: right ? "" : "end" }, label);
  }
}
