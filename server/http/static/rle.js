// COCO compressed RLE, decoded in the browser (the format of pycocotools' `counts` string).
//
// A mask is a list of run lengths over the pixels in column-major order (down the first
// column, then the next), starting with a run of 0s (possibly empty) and alternating.
// Each count is written as a variable-length number, 5 bits per character (low bits
// first), character code = 48 + (bits | 0x20 when more characters follow); bit 0x10 of the
// last character is the sign. From the fourth count on (index > 2), the value stored is
// the difference from the count two places earlier (the same colour's previous run), as
// in maskApi.c's rleToString / rleFrString.

/** The run lengths of a compressed `counts` string. */
export function rleCounts(counts) {
  const out = [];
  let p = 0;
  while (p < counts.length) {
    let x = 0;
    let scale = 1; // 2 ** (5 * k), in plain numbers so 32-bit shifts never overflow
    let more = true;
    while (more) {
      if (p >= counts.length) throw new Error("truncated RLE counts string");
      const c = counts.charCodeAt(p) - 48;
      if (c < 0 || c > 63) throw new Error(`bad character in RLE counts at ${p}`);
      x += (c & 0x1f) * scale;
      scale *= 32;
      more = (c & 0x20) !== 0;
      p += 1;
      if (!more && (c & 0x10)) x -= scale; // sign-extend: the top bit written was the sign
    }
    if (out.length > 2) x += out[out.length - 2];
    out.push(x);
  }
  return out;
}

/**
 * Decode `{size: [h, w], counts: "..."}` into a row-major Uint8Array of h*w (1 = mask),
 * the layout canvases use, so drawing needs no second pass.
 */
export function decodeRle(rle) {
  const [h, w] = rle.size;
  const mask = new Uint8Array(h * w);
  const runs = typeof rle.counts === "string" ? rleCounts(rle.counts) : rle.counts;
  let pos = 0; // column-major index of the next pixel
  let value = 0;
  for (const run of runs) {
    if (run < 0 || pos + run > h * w) throw new Error("RLE runs do not fit the mask size");
    if (value) {
      let x = Math.floor(pos / h);
      let y = pos - x * h;
      for (let i = 0; i < run; i += 1) {
        mask[y * w + x] = 1;
        y += 1;
        if (y === h) {
          y = 0;
          x += 1;
        }
      }
    }
    pos += run;
    value ^= 1;
  }
  return mask;
}

/** Pixels set in a decoded mask (the same number as the response's `area`). */
export function maskArea(mask) {
  let n = 0;
  for (let i = 0; i < mask.length; i += 1) n += mask[i];
  return n;
}
