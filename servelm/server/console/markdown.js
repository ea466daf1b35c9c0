// A small Markdown renderer for model output that builds DOM nodes and never parses HTML:
// every piece of the text reaches the page through createTextNode, so an answer holding
// <script> or <img onerror=...> shows those characters and runs nothing. Links are shown as
// text with their address, not made clickable.
//
// Blocks: fenced code (``` or ~~~, left open while an answer streams), headings, lists,
// block quotes, rules, GitHub-style pipe tables, paragraphs (single newlines kept).
// Inline: `code`, **bold**, *italic*, ~~struck~~, [text](address).

const FENCE = /^\s*(```+|~~~+)\s*([\w#+.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const DELIMITER_CELL = /^\s*(:?)-+(:?)\s*$/;
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source,             // 1, 2: code
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,                     // 3: bold
  /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/.source,            // 4: bold
  /\*(?=[^\s*])([^*]*?[^\s*])\*/.source,                   // 5: italic
  /(?<!\w)_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/.source,        // 6: italic
  /~~(?=\S)([\s\S]*?\S)~~/.source,                         // 7: struck
  /\[([^\]\n]+)\]\(([^()\s]+)\)/.source,                   // 8, 9: link
].join("|"), "g");

function el(tag, className) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  return e;
}

/** Inline Markdown of `text` appended to `parent` as elements and text nodes. */
export function renderInline(parent, text) {
  let last = 0;
  // matchAll scans a copy of the regex: the nested calls below cannot move this one's place.
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[2] !== undefined) {
      const code = el("code");
      code.textContent = m[2];
      parent.append(code);
    } else if (m[3] !== undefined || m[4] !== undefined) {
      renderInline(parent.appendChild(el("strong")), m[3] ?? m[4]);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      renderInline(parent.appendChild(el("em")), m[5] ?? m[6]);
    } else if (m[7] !== undefined) {
      renderInline(parent.appendChild(el("s")), m[7]);
    } else {
      renderInline(parent.appendChild(el("span", "link")), m[8]);
      const url = el("span", "url");
      url.textContent = ` (${m[9]})`;
      parent.append(url);
    }
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

/** A table row's cells: split on unescaped pipes, an outer pipe at either end dropped;
 * `\|` stands for a pipe inside a cell (code spans included, as on GitHub). */
function tableCells(line) {
  const cells = [""];
  const row = line.trim();
  for (let i = 0; i < row.length; i++) {
    if (row[i] === "\\" && row[i + 1] === "|") {
      cells[cells.length - 1] += "|";
      i++;
    } else if (row[i] === "|") {
      cells.push("");
    } else {
      cells[cells.length - 1] += row[i];
    }
  }
  if (row.startsWith("|")) cells.shift();
  if (cells.length > 1 && /(^|[^\\])\|$/.test(row)) cells.pop();
  return cells.map((c) => c.trim());
}

/** The columns' alignments ("left", "center", "right" or "") if `line` is a table's
 * delimiter row (`|---|:---:|--:|`), else null. */
function alignments(line) {
  if (!line.includes("-") || !/^[\s|:-]+$/.test(line)) return null;
  const cells = tableCells(line);
  const aligns = [];
  for (const cell of cells) {
    const m = DELIMITER_CELL.exec(cell);
    if (!m) return null;
    aligns.push(m[1] && m[2] ? "center" : m[2] ? "right" : m[1] ? "left" : "");
  }
  return aligns;
}

/** A <table> (in a wrapper that scrolls sideways if it must) of the header row, the
 * alignments and the body rows; each row has the header's number of cells, padded or cut. */
function table(header, aligns, rows) {
  const wrap = el("div", "table");
  const t = wrap.appendChild(el("table"));
  const addRow = (parent, cells, tag) => {
    const tr = parent.appendChild(el("tr"));
    aligns.forEach((align, j) => {
      const cell = tr.appendChild(el(tag));
      if (align) cell.dataset.align = align;
      renderInline(cell, cells[j] ?? "");
    });
  };
  addRow(t.appendChild(el("thead")), header, "th");
  if (rows.length) {
    const body = t.appendChild(el("tbody"));
    for (const cells of rows) addRow(body, cells, "td");
  }
  return wrap;
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, i) => {
    if (i) p.append(el("br"));
    renderInline(p, line);
  });
  return p;
}

/** `text` as Markdown: a DocumentFragment of safe nodes. */
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  const flush = () => {
    if (para.length) out.append(paragraph(para));
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const body = [];
      const close = new RegExp(`^\\s*${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      const pre = el("pre");
      const code = pre.appendChild(el("code"));
      if (m[2]) {
        code.dataset.lang = m[2];
        pre.dataset.lang = m[2];
      }
      code.textContent = body.join("\n");
      out.append(pre);
    } else if ((m = HEADING.exec(line))) {
      flush();
      const h = el(`h${Math.min(6, m[1].length + 2)}`);
      renderInline(h, m[2]);
      out.append(h);
    } else if (line.includes("|") && i + 1 < lines.length
               && alignments(lines[i + 1])?.length === tableCells(line).length) {
      // A header row, then its delimiter row; body rows up to a blank or pipeless line
      // (GitHub would take a pipeless line as a one-cell row; models mean a paragraph).
      flush();
      const aligns = alignments(lines[i + 1]);
      const rows = [];
      for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
        rows.push(tableCells(lines[i]));
      }
      i--;
      out.append(table(tableCells(line), aligns, rows));
    } else if (RULE.test(line)) {
      flush();
      out.append(el("hr"));
    } else if (QUOTE.test(line)) {
      flush();
      const body = [];
      for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) body.push(m[1]);
      i--;
      const q = el("blockquote");
      q.append(renderMarkdown(body.join("\n")));
      out.append(q);
    } else if ((m = ITEM.exec(line))) {
      flush();
      const ordered = /\d/.test(m[2]);
      const list = el(ordered ? "ol" : "ul");
      if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
      let item = null;
      for (; i < lines.length; i++) {
        const next = ITEM.exec(lines[i]);
        if (next && /\d/.test(next[2]) === ordered) {
          item = list.appendChild(el("li"));
          renderInline(item, next[3]);
        } else if (item && /^\s+\S/.test(lines[i])) {  // a continuation line of the item
          item.append(el("br"));
          renderInline(item, lines[i].trim());
        } else {
          break;
        }
      }
      i--;
      out.append(list);
    } else if (!line.trim()) {
      flush();
    } else {
      para.push(line);
    }
  }
  flush();
  return out;
}
