// The text around the image: errors, models and the random/synthetic-weights notes, timings,
// labels, and the mask lists. Pure rendering from plain values; the state lives in app.js.

import { cssColor, thumbnail } from "./draw.js";

const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

/** The error banner: one sentence per thing that failed; hidden when there is none. */
export function renderErrors(messages) {
  $("error-list").replaceChildren(...messages.map((text) => el("li", { textContent: text })));
  $("errors").hidden = messages.length === 0;
}

/** Model badges (name, precision, weights, device), the warning for random weights and
 * the note for synthetic ones (shapes, not objects). */
export function renderModels(models, loading = false) {
  if (!models.length) {
    const text = loading ? "models: still loading…" : "models: asking the server…";
    $("models").replaceChildren(el("li", { className: "muted", textContent: text }));
  } else {
    $("models").replaceChildren(...models.map((m) => {
      const where = m.device ? ` · ${m.device}` : "";
      const li = el("li", { textContent: `${m.name} · ${m.precision} · weights: ${m.weights}${where}` });
      li.dataset.weights = m.weights;
      if (m.weights === "random") li.classList.add("random");
      if (m.weights === "synthetic") li.classList.add("synthetic");
      return li;
    }));
  }
  const random = models.filter((m) => m.weights === "random").map((m) => m.name);
  $("random-warning").hidden = random.length === 0;
  const verb = random.length > 1 ? "run" : "runs";
  $("random-warning-text").textContent = random.length
    ? `${random.join(" and ")} ${verb} with seeded random weights (no checkpoint configured).`
    : "";
  const synthetic = models.filter((m) => m.weights === "synthetic").map((m) => m.name);
  $("synthetic-note").hidden = synthetic.length === 0;
  $("synthetic-note-text").textContent = synthetic.length
    ? `${synthetic.join(" and ")} ${synthetic.length > 1 ? "run" : "runs"} with synthetic weights,`
      + " trained to draw what a prompt names, not to find objects."
    : "";
}

/** One line per kind of call: the server's timing_ms and the round trip the page saw. */
export function showTiming(what, data) {
  const timing = $("timing");
  let dd = timing.querySelector(`dd[data-what="${what}"]`);
  if (!dd) {
    dd = el("dd");
    dd.dataset.what = what;
    timing.append(el("dt", { textContent: what }), dd);
  }
  const ms = data.timing_ms ?? {};
  const parts = Object.entries(ms)
    .filter(([k]) => k !== "total")
    .map(([k, v]) => `${k} ${v.toFixed(1)}`);
  const server = ms.total !== undefined
    ? `server ${ms.total.toFixed(1)} ms${parts.length ? ` (${parts.join(", ")})` : ""}`
    : `server: ${parts.join(", ") || "no timing"} ms`;
  dd.textContent = `${server}; ${data.roundTripMs.toFixed(0)} ms round trip`;
}

/** Swin's top-k, with bars relative to the first. */
export function renderLabels(predictions) {
  const top = predictions[0]?.score || 1;
  $("labels").replaceChildren(...predictions.map((p) => {
    const bar = el("span", { className: "bar" });
    bar.style.width = `${Math.max(1, (100 * p.score) / top)}%`;
    const li = el(
      "li", {},
      el("span", { className: "label", textContent: p.label }),
      el("span", { className: "muted", textContent: `${(100 * p.score).toFixed(2)}%` }),
      bar,
    );
    li.dataset.index = p.index;
    return li;
  }));
}

function swatch(color) {
  const node = el("span", { className: "swatch" });
  node.style.background = cssColor(color);
  return node;
}

/** A hint in place of masks (no image yet, or no prompt yet). */
export function renderMaskHint(text) {
  $("masks").replaceChildren(el("li", { className: "muted", textContent: text }));
}

/** The candidates of one prompt as buttons with thumbnails; `onSelect(i)` picks one. */
export function renderCandidates(answer, bitmap, onSelect) {
  $("masks").replaceChildren(...answer.candidates.map((c, i) => {
    const button = el(
      "button",
      { type: "button", className: "candidate", title: "Show this mask (the next click refines it)" },
      thumbnail(bitmap, c.layer),
      el(
        "span", {},
        swatch(c.color), ` #${i + 1} · score ${c.score.toFixed(3)}`, el("br"),
        el("span", { className: "muted", textContent: `${c.area.toLocaleString()} px` }),
      ),
    );
    button.setAttribute("aria-pressed", String(i === answer.selected));
    button.dataset.index = i;
    button.addEventListener("click", () => onSelect(i));
    return el("li", {}, button);
  }));
}

/** The "segment everything" masks, best score first, each with its colour. */
export function renderEverythingList(masks, limit = 100) {
  const sorted = masks.slice().sort((a, b) => b.score - a.score);
  const rows = sorted.slice(0, limit).map((m, i) => el(
    "li", { className: "everything-row" },
    swatch(m.color), `#${i + 1} · score ${m.score.toFixed(3)} · ${m.area.toLocaleString()} px`,
  ));
  if (sorted.length > limit) {
    // a long list helps nobody; the canvas shows them all
    rows.push(el("li", { className: "muted", textContent: `… and ${sorted.length - limit} more` }));
  }
  $("masks").replaceChildren(...rows);
}
