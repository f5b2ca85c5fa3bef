// Pointer gestures on the image: a click is a point, a drag is a box.
//
// Positions are turned into pixels of the original image here (the canvas is scaled by
// CSS), rounded and kept inside the image, so the rest of the page never sees screen
// coordinates. A press that moves less than a few screen pixels is a click, not a box.

const DRAG_PX = 4;

export function boxOf(a, b) {
  return [Math.min(a[0], b[0]), Math.min(a[1], b[1]), Math.max(a[0], b[0]), Math.max(a[1], b[1])];
}

/**
 * Listen on `canvas`. `imageSize()` gives [width, height] (0 while there is no image);
 * `onPoint([x, y], button)` for a click (button 0 left, 2 right); `onBox(box)` when a left
 * drag ends; `onDragBox(box | null)` while it is being drawn.
 */
export function attachGestures(canvas, { imageSize, onPoint, onBox, onDragBox }) {
  let drag = null;

  const toImage = (event) => {
    const [width, height] = imageSize();
    const rect = canvas.getBoundingClientRect();
    const x = ((event.clientX - rect.left) * width) / rect.width;
    const y = ((event.clientY - rect.top) * height) / rect.height;
    const clamp = (v, hi) => Math.min(Math.max(Math.round(v), 0), hi);
    return [clamp(x, width - 1), clamp(y, height - 1)];
  };

  canvas.addEventListener("contextmenu", (e) => e.preventDefault()); // right click = point
  canvas.addEventListener("pointerdown", (e) => {
    if (!imageSize()[0] || (e.button !== 0 && e.button !== 2)) return;
    canvas.setPointerCapture(e.pointerId);
    drag = { button: e.button, start: toImage(e), x: e.clientX, y: e.clientY, moved: false };
  });
  canvas.addEventListener("pointermove", (e) => {
    if (!drag || drag.button !== 0) return;
    if (Math.hypot(e.clientX - drag.x, e.clientY - drag.y) > DRAG_PX) drag.moved = true;
    if (drag.moved) onDragBox(boxOf(drag.start, toImage(e)));
  });
  canvas.addEventListener("pointerup", (e) => {
    const done = drag;
    drag = null;
    if (!done) return;
    if (!done.moved) {
      onPoint(done.start, done.button);
      return;
    }
    onDragBox(null);
    const box = boxOf(done.start, toImage(e));
    if (box[2] - box[0] >= 2 && box[3] - box[1] >= 2) onBox(box);
  });
  canvas.addEventListener("pointercancel", () => {
    drag = null;
    onDragBox(null);
  });
}
