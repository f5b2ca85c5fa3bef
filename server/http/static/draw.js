// Canvas drawing: mask overlays, candidate thumbnails, prompt marks, the mask PNG.
//
// Canvases hold the image at its own pixel size (CSS scales them to fit), so a mask pixel
// is a canvas pixel and prompt coordinates need only one scale factor, at the pointer.

import { decodeRle } from "./rle.js";

/** Colours of the 1st, 2nd and 3rd candidate of a prompt. */
export const CANDIDATE_COLORS = [
  [30, 120, 255],
  [255, 140, 0],
  [20, 170, 90],
];
const OVERLAY_ALPHA = 140;

/** N clearly different colours (golden-angle hues), for "segment everything". */
export function distinctColors(n) {
  const colors = [];
  for (let i = 0; i < n; i += 1) {
    const hue = (i * 137.508) % 360;
    colors.push(hslToRgb(hue, 0.75, i % 2 ? 0.45 : 0.58));
  }
  return colors;
}

function hslToRgb(h, s, l) {
  const k = (n) => (n + h / 30) % 12;
  const a = s * Math.min(l, 1 - l);
  const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
  return [Math.round(f(0) * 255), Math.round(f(8) * 255), Math.round(f(4) * 255)];
}

export function cssColor([r, g, b]) {
  return `rgb(${r} ${g} ${b})`;
}

/** A canvas of the image's size: `color` at OVERLAY_ALPHA where the mask is set. */
export function maskLayer(mask, width, height, color) {
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  const pixels = ctx.createImageData(width, height);
  const words = new Uint32Array(pixels.data.buffer); // RGBA bytes, little-endian words
  const [r, g, b] = color;
  const on = ((OVERLAY_ALPHA << 24) | (b << 16) | (g << 8) | r) >>> 0;
  for (let i = 0; i < mask.length; i += 1) if (mask[i]) words[i] = on;
  ctx.putImageData(pixels, 0, 0);
  return canvas;
}

/**
 * One canvas for many masks ("segment everything"): each RLE painted in its colour, later
 * ones over earlier ones, so every pixel shows one mask and no blend hides the edges.
 * Masks are decoded one at a time, so memory stays one image whatever their number.
 */
export function everythingLayer(rles, colors, width, height) {
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  const pixels = ctx.createImageData(width, height);
  const words = new Uint32Array(pixels.data.buffer);
  rles.forEach((rle, k) => {
    const mask = decodeRle(rle);
    const [r, g, b] = colors[k];
    const on = ((OVERLAY_ALPHA << 24) | (b << 16) | (g << 8) | r) >>> 0;
    for (let i = 0; i < mask.length; i += 1) if (mask[i]) words[i] = on;
  });
  ctx.putImageData(pixels, 0, 0);
  return canvas;
}

/** Draw layers in order onto the overlay canvas, replacing what was there. */
export function drawLayers(canvas, layers) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (const layer of layers) ctx.drawImage(layer, 0, 0);
}

/** A small picture of the image with one mask over it, for the candidate list. */
export function thumbnail(bitmap, layer, width = 192) {
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = Math.max(1, Math.round((bitmap.height * width) / bitmap.width));
  const ctx = canvas.getContext("2d");
  ctx.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  ctx.drawImage(layer, 0, 0, canvas.width, canvas.height);
  return canvas;
}

/**
 * Points (green: foreground, red with a cross: background), the box, and the box being
 * dragged; sizes are in CSS pixels times `scale` (image pixels per CSS pixel).
 */
export function drawPrompts(canvas, { points, box, dragBox }, scale) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const line = 2 * scale;
  for (const b of [box, dragBox]) {
    if (!b) continue;
    ctx.save();
    ctx.lineWidth = line;
    ctx.setLineDash(b === dragBox ? [6 * scale, 4 * scale] : []);
    ctx.strokeStyle = "#ffffff";
    ctx.strokeRect(b[0], b[1], b[2] - b[0], b[3] - b[1]);
    ctx.lineWidth = line / 2;
    ctx.strokeStyle = "#111827";
    ctx.strokeRect(b[0], b[1], b[2] - b[0], b[3] - b[1]);
    ctx.restore();
  }
  const radius = 6 * scale;
  for (const [x, y, label] of points) {
    ctx.beginPath();
    ctx.arc(x, y, radius, 0, 2 * Math.PI);
    ctx.fillStyle = label ? "#16a34a" : "#dc2626";
    ctx.fill();
    ctx.lineWidth = line;
    ctx.strokeStyle = "#ffffff";
    ctx.stroke();
    if (!label) {
      const d = radius * 0.5;
      ctx.beginPath();
      ctx.moveTo(x - d, y - d);
      ctx.lineTo(x + d, y + d);
      ctx.moveTo(x + d, y - d);
      ctx.lineTo(x - d, y + d);
      ctx.lineWidth = line * 0.75;
      ctx.stroke();
    }
  }
}

/** A black-and-white PNG of a mask (white = mask), as a Blob. */
export function maskPng(mask, width, height) {
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  const pixels = ctx.createImageData(width, height);
  const words = new Uint32Array(pixels.data.buffer);
  for (let i = 0; i < mask.length; i += 1) words[i] = mask[i] ? 0xffffffff : 0xff000000;
  ctx.putImageData(pixels, 0, 0);
  return new Promise((resolve, reject) =>
    canvas.toBlob((blob) => (blob ? resolve(blob) : reject(new Error("PNG failed"))), "image/png"),
  );
}
