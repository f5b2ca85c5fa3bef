// Calls to the service and the words a person reads when one fails.
//
// Every call sends the API key (when one is saved) as X-API-Key, and a call on an image its
// image_id as X-Image-Id (a proxy that hashes it sends every call on one image to the
// replica that holds its embedding). Errors arrive as
// {"error": {"code", "message"}} with an HTTP status; `ApiError` keeps all three, and
// `explain` turns them into a sentence that says what to do, with the server's message.

const KEY_STORE = "sam-swin-serve.api-key";

export function savedKey() {
  return sessionStorage.getItem(KEY_STORE) ?? "";
}

export function saveKey(key) {
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

export class ApiError extends Error {
  constructor(status, code, message, { retryAfter = null, key = "" } = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
    this.key = key; // the API key the call was made with
  }
}

/** The image_id of a file, as the server computes it: the SHA-256 of its bytes, hex. Null
 *  where the browser has no SubtleCrypto (a page served over plain http from another host
 *  than localhost): the call then goes without X-Image-Id, and the image_id the server
 *  answers is used from then on. */
export async function imageIdOf(file) {
  if (!globalThis.crypto?.subtle) return null;
  const digest = await crypto.subtle.digest("SHA-256", await file.arrayBuffer());
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

/** GET (no body), or POST a JSON value (`json`) or a FormData (`form`); the JSON answer.
 *  `imageId`, when known, goes as X-Image-Id. */
export async function api(path, { json, form, imageId } = {}) {
  const headers = {};
  const key = savedKey();
  if (key) headers["X-API-Key"] = key;
  if (imageId) headers["X-Image-Id"] = imageId;
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form; // the browser writes the multipart boundary itself
  }
  const started = performance.now();
  let res;
  try {
    res = await fetch(path, { method: body === undefined ? "GET" : "POST", headers, body });
  } catch (err) {
    throw new ApiError(0, "network", err.message || String(err), { key });
  }
  const text = await res.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!res.ok) {
    const error = data && data.error ? data.error : {};
    throw new ApiError(
      res.status,
      error.code ?? "http_error",
      error.message ?? (text.slice(0, 300) || res.statusText),
      { retryAfter: res.headers.get("Retry-After"), key },
    );
  }
  if (data === null) {
    throw new ApiError(res.status, "bad_response", "the answer was not JSON", { key });
  }
  data.roundTripMs = performance.now() - started;
  return data;
}

/** One sentence for a person: what went wrong, what to do, then the server's own words. */
export function explain(err, action) {
  if (!(err instanceof ApiError)) return `${action} failed: ${err.message || err}`;
  const said = err.message ? ` (server: ${err.message})` : "";
  if (err.status) action = `${action} (HTTP ${err.status})`;
  switch (err.status) {
    case 0:
      return `${action} failed: the server could not be reached. Is it still running? (${err.message})`;
    case 400:
      return `${action} failed: the server could not read this image; it may be corrupt or not an image${said}.`;
    case 401:
      return savedKey()
        ? `${action} failed: the server refused the API key you saved. Check it in the "API key" field at the top and press Save${said}.`
        : `${action} failed: this server needs an API key. Enter it in the "API key" field at the top and press Save${said}.`;
    case 404:
      return `${action} failed: the server no longer knows this image or mask; open the image again${said}.`;
    case 413:
      if (err.code === "everything_too_large") {
        return `${action} failed: the job needs more memory than the server allows; lower "points per side"${said}.`;
      }
      return `${action} failed: the image is too large for the server (its file size or pixel count is over the limit). Try a smaller image${said}.`;
    case 415:
      return `${action} failed: the server does not accept this kind of file${said}.`;
    case 422:
      return `${action} failed: the server refused the request's fields${said}.`;
    case 429: {
      const wait = err.retryAfter ? ` in ${err.retryAfter} s` : " shortly";
      return `${action} failed: the server is busy (its queue is full). Try again${wait}${said}.`;
    }
    case 503:
      return `${action} failed: the server is not ready (still loading or warming up, or shutting down). Try again in a moment${said}.`;
    case 504:
      return `${action} failed: the server did not finish in time${said}.`;
    default:
      return `${action} failed: the server answered with an error${said}.`;
  }
}
