// Decodes binary GSF1 frames off the main thread and hands back ImageBitmaps.
//
// Header (24 bytes, little-endian): magic "GSF1" | u8 kind | u8 format | u16 reserved |
// u32 chunk | u16 step | u16 frame_index | u16 width | u16 height | u32 payload_length.
// format: 0 raw rgb24, 1 jpeg, 2 webp. kind: 0 preview, 1 final.
"use strict";

const HEADER_SIZE = 24;
const MIME = { 1: "image/jpeg", 2: "image/webp" };

function parseHeader(buffer) {
  if (buffer.byteLength < HEADER_SIZE) throw new Error("frame shorter than its header");
  const view = new DataView(buffer);
  const magic = String.fromCharCode(
    view.getUint8(0), view.getUint8(1), view.getUint8(2), view.getUint8(3));
  if (magic !== "GSF1") throw new Error(`bad frame magic ${magic}`);
  return {
    kind: view.getUint8(4),
    format: view.getUint8(5),
    chunk: view.getUint32(8, true),
    step: view.getUint16(12, true),
    frameIndex: view.getUint16(14, true),
    width: view.getUint16(16, true),
    height: view.getUint16(18, true),
    payloadLength: view.getUint32(20, true),
  };
}

function rgbToImageData(payload, width, height) {
  // rgb24 rows -> RGBA for ImageData (alpha opaque).
  const pixels = width * height;
  if (payload.length !== pixels * 3) {
    throw new Error(`rgb payload is ${payload.length} bytes, expected ${pixels * 3}`);
  }
  const rgba = new Uint8ClampedArray(pixels * 4);
  for (let i = 0, j = 0; i < pixels; i++, j += 3) {
    const k = i * 4;
    rgba[k] = payload[j];
    rgba[k + 1] = payload[j + 1];
    rgba[k + 2] = payload[j + 2];
    rgba[k + 3] = 255;
  }
  return new ImageData(rgba, width, height);
}

async function decode(message) {
  const started = performance.now();
  const header = parseHeader(message.buffer);
  const payload = new Uint8Array(message.buffer, HEADER_SIZE, header.payloadLength);
  if (payload.length !== header.payloadLength) throw new Error("truncated frame payload");
  let bitmap;
  if (header.format === 0) {
    bitmap = await createImageBitmap(rgbToImageData(payload, header.width, header.height));
  } else if (MIME[header.format]) {
    bitmap = await createImageBitmap(new Blob([payload], { type: MIME[header.format] }));
  } else {
    throw new Error(`unknown frame format ${header.format}`);
  }
  return {
    header, bitmap, run: message.run, bytes: message.buffer.byteLength,
    receivedAt: message.receivedAt, decodeMs: performance.now() - started,
  };
}

// Decode in arrival order: createImageBitmap is asynchronous, and final frames must not swap.
let chain = Promise.resolve();
self.onmessage = (event) => {
  const message = event.data;
  chain = chain.then(async () => {
    try {
      const result = await decode(message);
      self.postMessage(result, [result.bitmap]);
    } catch (err) {
      self.postMessage({ error: String(err && err.message ? err.message : err), run: message.run });
    }
  });
};
