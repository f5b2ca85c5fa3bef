// The page: open an image, click or drag prompts, see masks, labels and timings.
//
// One image at a time. It is sent once to /v1/embed and afterwards named by its image_id,
// so a click costs only the mask decoder. Prompt states form an undo stack; each keeps
// the answer it got and the low-res handle of its chosen mask, which the next click sends
// back as `mask_input` (SAM refines the previous mask rather than starting over).

import { api, ApiError, explain, imageIdOf, saveKey, savedKey } from "./api.js";
import {
  CANDIDATE_COLORS, distinctColors, drawLayers, drawPrompts, everythingLayer, maskLayer, maskPng,
} from "./draw.js";
import { attachGestures } from "./gestures.js";
import {
  renderCandidates, renderErrors, renderEverythingList, renderLabels, renderMaskHint, renderModels,
  showTiming,
} from "./panels.js";
import { decodeRle } from "./rle.js";

const $ = (id) => document.getElementById(id);
const stage = $("stage");
const imageCanvas = $("image-canvas");
const maskCanvas = $("mask-canvas");
const promptCanvas = $("prompt-canvas");

const emptyPrompt = () => ({ points: [], box: null, answer: null, handle: null });

const state = {
  file: null,
  bitmap: null,
  width: 0,
  height: 0,
  token: 0, // bumped per opened image; answers for an older image are dropped
  embedding: null, // Promise<image_id> while or after embedding
  fileId: Promise.resolve(null), // Promise<image_id | null>: the file's SHA-256, for X-Image-Id
  imageId: null, // once the server has the embedding
  classified: false,
  history: [emptyPrompt()], // undo stack; the last entry is what is on screen
  seq: 0, // bumped per segment request; only the newest answer is drawn
  everything: null, // {layer, masks: [{color, score, area}]} while showing "segment everything"
  dragBox: null, // the box being dragged, drawn dashed
  models: new Map(), // name -> {name, weights, precision, device?}
  errors: new Map(), // what failed -> sentence
};

const current = () => state.history[state.history.length - 1];
const hasPrompt = (p) => p.points.length > 0 || p.box !== null;

// ---- messages --------------------------------------------------------------------------

function setStatus(text) {
  $("status").textContent = text;
}

function fail(what, err) {
  // A 401 for a key that has since been replaced is stale: saving the key retried it.
  if (err instanceof ApiError && err.status === 401 && err.key !== savedKey()) return;
  state.errors.set(what, explain(err, what));
  renderErrors([...state.errors.values()]);
}

function succeed(...whats) {
  for (const what of whats) state.errors.delete(what);
  renderErrors([...state.errors.values()]);
}

// ---- models ----------------------------------------------------------------------------

function noteModel(model, loading = false) {
  if (model) state.models.set(model.name, { ...state.models.get(model.name), ...model });
  renderModels([...state.models.values()], loading);
}

async function loadModels() {
  try {
    const data = await api("/v1/models");
    for (const m of data.models) noteModel(m);
    if (!data.models.length) noteModel(null, true);
    succeed("Asking the server which models are loaded");
  } catch (err) {
    fail("Asking the server which models are loaded", err);
  }
}

// ---- the image -------------------------------------------------------------------------

async function openFile(file) {
  if (!file) return;
  let bitmap;
  try {
    bitmap = await createImageBitmap(file, { imageOrientation: "from-image" });
  } catch {
    fail("Opening the file", new Error(`"${file.name}" is not an image this browser can show.`));
    return;
  }
  state.token += 1;
  state.seq += 1;
  Object.assign(state, {
    file, bitmap, width: bitmap.width, height: bitmap.height, embedding: null, imageId: null,
    fileId: imageIdOf(file).catch(() => null),
    classified: false, history: [emptyPrompt()], everything: null,
  });
  stage.classList.remove("busy"); // an answer for the old image will not come back to clear it
  succeed(...[...state.errors.keys()].filter((what) => !what.startsWith("Asking")));
  for (const canvas of [imageCanvas, maskCanvas, promptCanvas]) {
    canvas.width = bitmap.width;
    canvas.height = bitmap.height;
  }
  imageCanvas.getContext("2d").drawImage(bitmap, 0, 0);
  stage.classList.remove("empty");
  $("labels").replaceChildren();
  render();
  setStatus(`${file.name}: ${bitmap.width}×${bitmap.height}. Encoding…`);
  ensureEmbedded().then(
    () => setStatus(`${file.name}: ${state.width}×${state.height}. Click to add points, drag for a box.`),
    (err) => fail("Encoding the image", err),
  );
  classify();
}

/** The image_id, embedding the image first if that has not been done (or failed). */
function ensureEmbedded() {
  if (!state.embedding) {
    const token = state.token;
    const form = new FormData();
    form.append("image", state.file, state.file.name);
    const embedding = state.fileId.then((imageId) => api("/v1/embed", { form, imageId })).then(
      (data) => {
        if (token !== state.token) return data.image_id;
        state.imageId = data.image_id;
        state.fileId = Promise.resolve(data.image_id); // known now, hashed here or not
        showTiming("embed", data);
        succeed("Encoding the image");
        if (data.width !== state.width || data.height !== state.height) {
          const sizes = `${data.width}×${data.height} on the server, ${state.width}×${state.height} here`;
          fail("Encoding the image", new Error(`image sizes differ (${sizes}): points may miss`));
        }
        return data.image_id;
      },
      (err) => {
        if (state.embedding === embedding) state.embedding = null; // the next click tries again
        throw err;
      },
    );
    state.embedding = embedding;
  }
  return state.embedding;
}

async function classify() {
  const token = state.token;
  const form = new FormData();
  form.append("image", state.file, state.file.name);
  form.append("request", JSON.stringify({ top_k: 5 }));
  try {
    const data = await api("/v1/classify", { form, imageId: await state.fileId });
    if (token !== state.token) return;
    state.classified = true;
    noteModel(data.model);
    showTiming("classify", data);
    succeed("Classifying the image");
    renderLabels(data.predictions);
  } catch (err) {
    if (token === state.token) fail("Classifying the image", err);
  }
}

// ---- prompts and masks -----------------------------------------------------------------

function decodeMasks(objects, colors) {
  return objects.map((m, i) => {
    const mask = decodeRle(m.segmentation);
    return {
      mask, score: m.score, area: m.area, handle: m.low_res_handle ?? null, color: colors[i],
      layer: maskLayer(mask, state.width, state.height, colors[i]),
    };
  });
}

function pushPrompt(change) {
  const prev = current();
  state.history.push({
    ...emptyPrompt(),
    points: change.point ? [...prev.points, change.point] : prev.points,
    box: change.box ?? prev.box,
  });
  state.everything = null;
  segment();
}

async function segment(retried = false) {
  const prompt = current();
  const seq = ++state.seq;
  const multimask = $("multimask").checked;
  render();
  if (!hasPrompt(prompt)) return;
  if (prompt.answer && prompt.answer.multimask === multimask) return; // undo: already known
  const below = state.history[state.history.length - 2];
  const body = { multimask_output: multimask };
  if (prompt.points.length) {
    body.point_coords = prompt.points.map(([x, y]) => [x, y]);
    body.point_labels = prompt.points.map(([, , label]) => label);
  }
  if (prompt.box) body.box = prompt.box;
  body.return_low_res_logits = true;
  if (below?.handle) body.mask_input = below.handle;
  stage.classList.add("busy");
  setStatus("Segmenting…");
  try {
    body.image_id = await ensureEmbedded();
    if (seq !== state.seq) return;
    const data = await api("/v1/segment", { json: body, imageId: body.image_id });
    const masks = data.results[0].masks;
    prompt.answer = { multimask, selected: 0, candidates: decodeMasks(masks, CANDIDATE_COLORS) };
    prompt.handle = prompt.answer.candidates[0]?.handle ?? null;
    noteModel(data.model);
    showTiming("segment", data);
    succeed("Segmenting", "Encoding the image");
    if (seq !== state.seq) return; // a newer prompt is on its way; its answer will draw
    const best = masks[0] ? `; best score ${masks[0].score.toFixed(3)}` : "";
    setStatus(`${masks.length} mask${masks.length === 1 ? "" : "s"}${best}.`);
    render();
  } catch (err) {
    if (seq !== state.seq) return;
    if (!retried && (await recover(err, body))) return segment(true);
    fail("Segmenting", err);
    setStatus("Segmenting failed; see the message above.");
  } finally {
    if (seq === state.seq) stage.classList.remove("busy");
  }
}

/** After a failed segment call: fix what can be fixed here and say whether to retry.
 *  Decided by the error envelope's stable `code`, never by the wording of its message. */
async function recover(err, body) {
  if (!(err instanceof ApiError)) return false;
  if (err.code === "unknown_image_id") {
    state.embedding = null; // evicted from the server's cache: encode again
    state.imageId = null;
    return true;
  }
  if (err.code === "unknown_mask_input" && body.mask_input) {
    const below = state.history[state.history.length - 2];
    if (below) below.handle = null; // expired on the server: start this mask afresh
    return true;
  }
  return false;
}

function selectCandidate(index) {
  const answer = current().answer;
  if (!answer || !answer.candidates[index]) return;
  answer.selected = index;
  current().handle = answer.candidates[index].handle;
  render();
}

async function segmentEverything(retried = false) {
  const seq = ++state.seq; // a prompt answer still on its way must not draw over this
  const fields = {
    points_per_side: Number($("pps").value) || 16,
    pred_iou_thresh: Number($("iou-thresh").value),
    stability_score_thresh: Number($("stability-thresh").value),
    box_nms_thresh: Number($("nms-thresh").value),
  };
  $("everything").disabled = true;
  stage.classList.add("busy");
  setStatus("Segmenting everything…");
  try {
    const image_id = await ensureEmbedded();
    const json = { image_id, ...fields };
    const data = await api("/v1/segment/everything", { json, imageId: image_id });
    if (seq !== state.seq) return; // the person clicked, cleared or opened another image
    const order = [...data.masks].sort((a, b) => b.area - a.area); // small ones drawn on top
    const colors = distinctColors(order.length);
    state.everything = {
      layer: everythingLayer(order.map((m) => m.segmentation), colors, state.width, state.height),
      masks: order.map((m, i) => ({ color: colors[i], score: m.score, area: m.area })),
    };
    noteModel(data.model);
    showTiming("everything", data);
    succeed("Segmenting everything");
    const filters =
      `predicted IoU ≥ ${fields.pred_iou_thresh}, stability ≥ ${fields.stability_score_thresh}`;
    setStatus(data.masks.length
      ? `${data.masks.length} masks. Click the image to go back to prompts.`
      : `No mask passed the filters (${filters}). Lower them under "Everything settings".`);
    render();
  } catch (err) {
    if (seq !== state.seq) return;
    if (!retried && err instanceof ApiError && err.code === "unknown_image_id") {
      state.embedding = null; // evicted from the server's cache: encode again
      state.imageId = null;
      return await segmentEverything(true);
    }
    fail("Segmenting everything", err);
    setStatus("Segment everything failed; see the message above.");
  } finally {
    if (seq === state.seq) stage.classList.remove("busy");
    $("everything").disabled = !state.bitmap;
  }
}

// ---- drawing ---------------------------------------------------------------------------

function selectedCandidate() {
  const answer = current().answer;
  return answer ? answer.candidates[answer.selected] ?? null : null;
}

function render() {
  const prompt = current();
  const chosen = selectedCandidate();
  if (state.everything) drawLayers(maskCanvas, [state.everything.layer]);
  else drawLayers(maskCanvas, chosen ? [chosen.layer] : []);
  renderPrompts();
  renderMaskList();
  $("undo").disabled = state.history.length < 2;
  $("clear").disabled = !hasPrompt(prompt) && !state.everything;
  $("everything").disabled = !state.bitmap;
  $("download").disabled = state.everything !== null || !chosen;
}

function pixelScale() {
  const rect = promptCanvas.getBoundingClientRect();
  return rect.width ? state.width / rect.width : 1;
}

function renderPrompts() {
  const shown = state.everything ? emptyPrompt() : current();
  const marks = { points: shown.points, box: shown.box, dragBox: state.dragBox };
  drawPrompts(promptCanvas, marks, pixelScale());
}

function renderMaskList() {
  const answer = current().answer;
  if (state.everything) renderEverythingList(state.everything.masks);
  else if (answer) renderCandidates(answer, state.bitmap, selectCandidate);
  else renderMaskHint(state.bitmap ? "Click the image or drag a box." : "No image yet.");
}

// ---- pointer, keys, buttons --------------------------------------------------------------

attachGestures(promptCanvas, {
  imageSize: () => [state.width, state.height],
  onPoint: ([x, y], button) => {
    const background = button === 2 || $("bg-toggle").getAttribute("aria-pressed") === "true";
    pushPrompt({ point: [x, y, background ? 0 : 1] });
  },
  onBox: (box) => pushPrompt({ box }),
  onDragBox: (box) => {
    state.dragBox = box;
    renderPrompts();
  },
});

function undo() {
  if (state.history.length < 2) return;
  state.history.pop();
  state.everything = null;
  segment();
}

function clear() {
  state.history = [emptyPrompt()];
  state.everything = null;
  state.seq += 1; // answers still on their way are dropped
  stage.classList.remove("busy");
  render();
  if (state.bitmap) setStatus("Cleared. Click to add points, drag for a box.");
}

$("undo").addEventListener("click", undo);
$("clear").addEventListener("click", clear);
$("multimask").addEventListener("change", () => segment());
$("everything").addEventListener("click", () => segmentEverything());
$("bg-toggle").addEventListener("click", (e) => {
  const on = e.currentTarget.getAttribute("aria-pressed") !== "true";
  e.currentTarget.setAttribute("aria-pressed", String(on));
});
$("download").addEventListener("click", async () => {
  const chosen = selectedCandidate();
  if (!chosen) return;
  const blob = await maskPng(chosen.mask, state.width, state.height);
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${state.file.name.replace(/\.[^.]*$/, "") || "image"}-mask.png`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
});
$("errors-close").addEventListener("click", () => succeed(...state.errors.keys()));
document.addEventListener("keydown", (e) => {
  if (e.target instanceof HTMLInputElement) return;
  if ((e.ctrlKey || e.metaKey) && e.key.toLowerCase() === "z") {
    e.preventDefault();
    undo();
  } else if (e.key === "Escape") {
    clear();
  }
});
window.addEventListener("resize", () => state.bitmap && renderPrompts());

// Files: the picker, or dropped anywhere on the page.
$("file-input").addEventListener("change", (e) => openFile(e.target.files[0]));
document.addEventListener("dragover", (e) => {
  e.preventDefault();
  stage.classList.add("dragover");
});
document.addEventListener("dragleave", (e) => {
  if (!e.relatedTarget) stage.classList.remove("dragover");
});
document.addEventListener("drop", (e) => {
  e.preventDefault();
  stage.classList.remove("dragover");
  const files = [...(e.dataTransfer?.files ?? [])];
  openFile(files.find((f) => f.type.startsWith("image/")) ?? files[0]);
});

// The API key: kept for this tab only; saving it retries whatever it blocked.
$("api-key").value = savedKey();
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  saveKey($("api-key").value.trim());
  succeed(...state.errors.keys());
  loadModels();
  if (!state.bitmap) return;
  if (!state.imageId) state.embedding = null; // a call with the old key may still be out
  ensureEmbedded().catch((err) => fail("Encoding the image", err));
  if (!state.classified) classify();
  if (hasPrompt(current()) && !current().answer) segment();
});

render();
loadModels();
