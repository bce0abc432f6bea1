// genserve realtime client: a WebSocket session, a decoder Web Worker, and a
// requestAnimationFrame draw loop. Three modes over the same protocol: video, image
// (text-to-image) and edit (an uploaded picture + an instruction); finished images go to the
// gallery (gallery.js) as a "genserve:image" event. Protocol: docs/realtime_protocol.md.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const canvas = $("canvas");
  const ctx = canvas.getContext("2d");
  const KIND_PREVIEW = 0;
  const KIND_FINAL = 1;
  // Errors after which the server is still running the generation (it only refused a message).
  const NON_FATAL = new Set(["busy", "not_running", "invalid_json", "invalid_message"]);
  const VIDEO_TASKS = ["text-to-video", "image-to-video"];
  // Tasks whose requests bring pictures (the model's card says how many).
  const IMAGE_INPUT_TASKS = ["image-edit", "inpainting", "image-to-video"];
  // Which models each mode offers; "edit" also takes text-to-image models that do
  // image-to-image (their card says `image_to_image`) or edit from reference pictures
  // (FLUX.2: their card says `max_reference_images`).
  const MODE_FILTERS = {
    video: (m) => VIDEO_TASKS.includes(m.task),
    image: (m) => m.task === "text-to-image",
    edit: (m) => ["image-edit", "inpainting"].includes(m.task)
      || (m.task === "text-to-image" && (m.image_to_image || m.max_reference_images > 0)),
  };

  const state = {
    ws: null,
    reconnectDelayMs: 500,
    running: false,
    awaitingStart: false,
    run: 0,               // bumped on every start/stop: frames of older runs are discarded
    settings: null,       // the server's `started` message
    models: [],
    mode: "video",
    inputImages: [],      // data URLs of the picture(s) to edit / animate
    maskImage: null,      // data URL of the inpainting mask
    runPrompt: "",        // the prompt of the running generation (for the gallery)
    startSentAt: 0,
    firstPreviewSeen: false,
    finals: [],           // decoded final frames waiting for their turn on the canvas
    preview: null,        // the newest decoded preview {bitmap, drawn}
    lastFinalDrawnAt: -1e9,
    drawTimes: [],        // performance.now() of recent canvas draws (render fps)
    frameBytes: [],
    decodeMs: [],
    recorder: null,       // MediaRecorder while the Record button is on
  };
  // Counters for people and tests (the browser test reads them).
  const stats = {
    previewsReceived: 0, previewsDrawn: 0, finalsReceived: 0, finalsDrawn: 0,
    finalDrawTimes: [], chunksDone: 0, errors: [], lastChunkStats: null,
  };
  window.genserveRealtime = { state, stats };

  // ---- decoder worker ----
  const worker = new Worker("/ui/decoder_worker.js");
  worker.onmessage = (event) => onDecoded(event.data);
  worker.onerror = (event) => showError(`Frame decoder failed: ${event.message}`);

  // ---- connection (reconnects after a server restart) ----
  // With `genserve serve --api-key K`, open the page as /?api_key=K.
  const apiKey = new URLSearchParams(location.search).get("api_key");

  function wsUrl() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const query = apiKey ? `?api_key=${encodeURIComponent(apiKey)}` : "";
    return `${proto}//${location.host}/v1/realtime/video${query}`;
  }

  function setConnection(status, text) {
    const badge = $("connection");
    badge.dataset.status = status;
    badge.textContent = text;
  }

  function connect() {
    setConnection("connecting", "connecting…");
    const ws = new WebSocket(wsUrl());
    ws.binaryType = "arraybuffer";
    state.ws = ws;
    ws.onopen = () => {
      state.reconnectDelayMs = 500;
      setConnection("open", "connected");
      loadModels();
      updateButtons();
    };
    ws.onmessage = (event) => {
      if (typeof event.data === "string") onControl(JSON.parse(event.data));
      else onFrame(event.data);
    };
    ws.onclose = (event) => {
      state.ws = null;
      if (state.running || state.awaitingStart) {
        showError(`Connection lost (code ${event.code}); the generation stopped.`);
        finishRun("error");
      }
      const delay = state.reconnectDelayMs;
      state.reconnectDelayMs = Math.min(delay * 2, 5000);
      setConnection("closed", `disconnected · retrying in ${(delay / 1000).toFixed(1)} s`);
      updateButtons();
      setTimeout(connect, delay);
    };
  }

  // ---- models ----
  async function loadModels() {
    let cards;
    try {
      const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
      const response = await fetch("/v1/models", { headers });
      const body = await response.json();
      if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
      cards = body.data.filter((m) => m.kind === "diffusion");
    } catch (err) {
      showError(`Could not list models: ${err.message}`);
      return;
    }
    // Text-to-video models first (a video mode's first pick should not need a picture), and
    // among them streaming models first: they play one continuous video.
    const rank = (m) => (m.task === "text-to-video") * 2 + (m.streaming === true);
    cards.sort((a, b) => rank(b) - rank(a));
    state.models = cards;
    if (!cards.length) {
      showError("This server serves no diffusion model.");
      return;
    }
    // Start in video mode when a video model is served, else in image mode.
    if (!cards.some(MODE_FILTERS[state.mode])) {
      const mode = ["video", "image", "edit"].find((m) => cards.some(MODE_FILTERS[m]));
      $("mode").value = mode;
      state.mode = mode;
      document.body.dataset.mode = mode;
    }
    fillModelList();
  }

  function fillModelList() {
    const select = $("model");
    const previous = select.value;
    const cards = state.models.filter(MODE_FILTERS[state.mode]);
    select.replaceChildren(...cards.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = `${m.id} (${m.task})`;
      return option;
    }));
    if (cards.some((m) => m.id === previous)) {
      select.value = previous;
      updateInputs();
    } else if (cards.length) {
      select.value = cards[0].id;
      applyModelDefaults();
    } else {
      updateInputs();
    }
  }

  function setMode(mode) {
    state.mode = mode;
    document.body.dataset.mode = mode;
    if (!state.models.some(MODE_FILTERS[mode])) {
      showError(`This server serves no model for ${mode} mode.`);
    } else {
      clearError();
    }
    fillModelList();
  }

  function selectedCard() {
    return state.models.find((m) => m.id === $("model").value);
  }

  // Which picture inputs the selected model takes: reference pictures (edit, inpainting,
  // image-to-video), a mask (inpainting), or one starting picture and a strength
  // (image-to-image on a text-to-image model, in edit mode).
  function inputNeeds() {
    const card = selectedCard();
    if (!card) return { images: 0, mask: false, strength: false };
    if (IMAGE_INPUT_TASKS.includes(card.task)) {
      return { images: card.max_reference_images || 1, mask: card.task === "inpainting",
        strength: false };
    }
    if (state.mode === "edit" && card.max_reference_images > 0) {
      return { images: card.max_reference_images, mask: false, strength: false };
    }
    const img2img = state.mode === "edit" && card.task === "text-to-image";
    return { images: img2img ? 1 : 0, mask: false, strength: img2img };
  }

  function updateInputs() {
    const needs = inputNeeds();
    $("image-input").hidden = needs.images === 0;
    $("input-image").multiple = needs.images > 1;
    $("mask-row").hidden = !needs.mask;
    $("strength-row").hidden = !needs.strength;
    if (state.inputImages.length > needs.images) setInputImages(state.inputImages.slice(0, needs.images));
  }

  function readAsDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  function setInputImages(urls) {
    state.inputImages = urls;
    $("input-preview").replaceChildren(...urls.map((url) => {
      const img = document.createElement("img");
      img.src = url;
      img.alt = "picture to edit";
      return img;
    }));
  }

  async function onPicturesChosen() {
    const files = Array.from($("input-image").files || []);
    const limit = Math.max(1, inputNeeds().images);
    try {
      setInputImages(await Promise.all(files.slice(0, limit).map(readAsDataUrl)));
    } catch (err) {
      showError(`Could not read the picture: ${err.message}`);
    }
  }

  async function onMaskChosen() {
    const file = ($("input-mask").files || [])[0];
    state.maskImage = file ? await readAsDataUrl(file) : null;
  }

  function applyModelDefaults() {
    updateInputs();
    const card = selectedCard();
    if (!card) return;
    const [w, h] = String(card.default_size || "").split("x").map(Number);
    if (w && h) { $("width").value = w; $("height").value = h; }
    const factor = card.size_factor || 16;
    $("width").step = $("height").step = factor;
    $("width").min = $("height").min = factor;
    if (card.default_steps) $("steps").value = card.default_steps;
    $("frames").value = VIDEO_TASKS.includes(card.task) ? (card.default_num_frames || 1) : 1;
    if (card.default_fps) $("fps").value = card.default_fps;
    // A streaming model plays one endless video: continuous is its natural mode.
    $("continuous").checked = card.streaming === true;
    updateButtons();
    // Narrow models (the trained demo models) say which prompts they understand.
    const grammar = $("grammar");
    grammar.hidden = !card.prompt_grammar;
    grammar.textContent = card.prompt_grammar ? `Prompts this model understands: ${card.prompt_grammar}` : "";
  }

  // ---- user actions ----
  function intValue(id) {
    const value = $(id).value.trim();
    return value === "" ? undefined : Number.parseInt(value, 10);
  }

  function start() {
    if (!state.ws || state.ws.readyState !== WebSocket.OPEN) {
      showError("Not connected to the server yet.");
      return;
    }
    const prompt = $("prompt").value.trim();
    if (!prompt) {
      showError("Write a prompt first.");
      return;
    }
    const needs = inputNeeds();
    if (needs.images && !state.inputImages.length) {
      showError("Pick a picture first: this model works from an uploaded picture.");
      return;
    }
    if (needs.mask && !state.maskImage) {
      showError("Pick a mask too: white marks what the model repaints.");
      return;
    }
    const video = state.mode === "video";
    const message = {
      type: "start",
      model: $("model").value || undefined,
      prompt,
      num_inference_steps: intValue("steps"),
      seed: intValue("seed"),
      preview_format: $("format").value,
      preview_quality: intValue("quality"),
      continuous: video && $("continuous").checked,
    };
    // An edit keeps the picture's size (the server's default); otherwise the size fields.
    if (state.mode !== "edit") {
      message.width = intValue("width");
      message.height = intValue("height");
    }
    if (video) {
      message.num_frames = intValue("frames");
      message.fps = intValue("fps");
    }
    if (needs.images) message.images = state.inputImages;
    if (needs.mask) message.mask = state.maskImage;
    if (needs.strength) message.strength = Number($("strength").value);
    state.runPrompt = prompt;
    clearError();
    resetRun();
    state.awaitingStart = true;
    state.startSentAt = performance.now();
    state.ws.send(JSON.stringify(message));
    setStage("starting…", 0);
    document.body.dataset.state = "starting";
    updateButtons();
  }

  function stop() {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) {
      state.ws.send(JSON.stringify({ type: "stop" }));
    }
    resetRun();  // drop frames already on their way
    updateButtons();
  }

  function sendPrompt() {
    const prompt = $("prompt").value.trim();
    if (!prompt || !state.running || !state.ws) return;
    state.ws.send(JSON.stringify({ type: "prompt", prompt }));
    setStage(`${$("stage").textContent} · new prompt queued`);
  }

  function newScene() {
    if (!state.running || !state.ws || !state.settings || !state.settings.streaming) return;
    state.ws.send(JSON.stringify({ type: "reset" }));
    setStage(`${$("stage").textContent} · new scene queued`);
  }

  // ---- recording what the canvas plays (MediaRecorder over canvas.captureStream) ----
  function toggleRecording() {
    if (state.recorder) {
      state.recorder.stop();
      return;
    }
    if (typeof MediaRecorder === "undefined" || !canvas.captureStream) {
      showError("This browser cannot record the canvas.");
      return;
    }
    const type = ["video/webm;codecs=vp9", "video/webm;codecs=vp8", "video/webm"]
      .find((t) => MediaRecorder.isTypeSupported(t));
    const recorder = new MediaRecorder(canvas.captureStream(frameRate()),
      type ? { mimeType: type } : undefined);
    const parts = [];
    recorder.ondataavailable = (event) => { if (event.data.size) parts.push(event.data); };
    recorder.onstop = () => {
      const blob = new Blob(parts, { type: recorder.mimeType || "video/webm" });
      const link = $("recording");
      if (link.href) URL.revokeObjectURL(link.href);
      link.href = URL.createObjectURL(blob);
      link.download = `genserve-${Date.now()}.webm`;
      link.dataset.bytes = String(blob.size);
      link.hidden = false;
      state.recorder = null;
      $("record").textContent = "Record";
      document.body.dataset.recording = "saved";
    };
    recorder.start(250);
    state.recorder = recorder;
    $("record").textContent = "Stop recording";
    document.body.dataset.recording = "on";
  }

  function frameRate() {
    return (state.settings && state.settings.fps) || intValue("fps") || 12;
  }

  function resetRun() {
    state.run += 1;
    for (const frame of state.finals) frame.bitmap.close();
    state.finals = [];
    if (state.preview) state.preview.bitmap.close();
    state.preview = null;
    state.firstPreviewSeen = false;
  }

  // ---- server messages ----
  function onControl(message) {
    switch (message.type) {
      case "started":
        state.awaitingStart = false;
        state.running = true;
        state.settings = message;
        canvas.width = message.width;
        canvas.height = message.height;
        document.body.dataset.state = "running";
        setStage(`step 0/${message.num_inference_steps}`, 0);
        updateButtons();
        break;
      case "progress":
        setStage(`chunk ${message.chunk + 1} · step ${message.step}/${message.total_steps}`,
          message.step / message.total_steps);
        break;
      case "chunk_done":
        stats.chunksDone += 1;
        stats.lastChunkStats = message.stats;
        $("chunk-time").textContent = `${Math.round(message.stats.generate_ms)} ms`;
        if (message.stats.realtime_factor !== undefined) {
          // Below 1 the server makes video slower than it plays: say so, with the real rate.
          const factor = message.stats.realtime_factor;
          const fps = factor * frameRate();
          $("realtime-factor").textContent = factor >= 1
            ? `${factor.toFixed(2)}x (keeps up)`
            : `${factor.toFixed(2)}x: generating ${fps.toFixed(1)} fps, slower than playback`;
          $("realtime-factor").dataset.behind = String(factor < 1);
        }
        break;
      case "done":
        setStage(message.stopped ? "stopped" : `done · ${message.chunks} chunk(s)`,
          message.stopped ? undefined : 1);
        finishRun(message.stopped ? "stopped" : "done");
        break;
      case "error":
        stats.errors.push(message);
        showError(`${message.message} (${message.code})`);
        if ((state.running || state.awaitingStart) && !NON_FATAL.has(message.code)) {
          finishRun("error");
        }
        break;
      default:
        break;
    }
  }

  function finishRun(finalState) {
    state.running = false;
    state.awaitingStart = false;
    document.body.dataset.state = finalState;
    updateButtons();
  }

  function onFrame(buffer) {
    worker.postMessage({ buffer, run: state.run, receivedAt: performance.now() }, [buffer]);
  }

  function onDecoded(result) {
    if (result.error) {
      if (result.run === state.run) showError(`Could not decode a frame: ${result.error}`);
      return;
    }
    if (result.run !== state.run) {
      result.bitmap.close();
      return;
    }
    pushWindow(state.frameBytes, result.bytes, 30);
    pushWindow(state.decodeMs, result.decodeMs, 30);
    if (result.header.kind === KIND_PREVIEW) {
      stats.previewsReceived += 1;
      if (!state.firstPreviewSeen) {
        state.firstPreviewSeen = true;
        const latency = result.receivedAt - state.startSentAt;
        $("preview-latency").textContent = `${Math.round(latency)} ms`;
      }
      if (state.preview) state.preview.bitmap.close();
      state.preview = { bitmap: result.bitmap, drawn: false };
    } else if (result.header.kind === KIND_FINAL) {
      stats.finalsReceived += 1;
      if (state.settings && !VIDEO_TASKS.includes(state.settings.task)) publishImage(result);
      state.finals.push(result);
    } else {
      result.bitmap.close();
    }
  }

  // A finished image (one final frame of an image task) goes to the gallery as a PNG.
  function publishImage(result) {
    const { bitmap, header } = result;
    const copy = document.createElement("canvas");
    copy.width = bitmap.width;
    copy.height = bitmap.height;
    copy.getContext("2d").drawImage(bitmap, 0, 0);
    const s = state.settings;
    const detail = {
      canvas: copy, prompt: state.runPrompt, model: s.model, task: s.task,
      seed: s.seed + header.chunk, steps: header.step, width: s.width, height: s.height,
    };
    stats.imagesPublished = (stats.imagesPublished || 0) + 1;
    window.dispatchEvent(new CustomEvent("genserve:image", { detail }));
  }

  // Another script (the gallery) hands a picture to edit: switch to edit mode with it.
  function editPicture(dataUrl) {
    $("mode").value = "edit";
    setMode("edit");
    setInputImages([dataUrl]);
    $("input-image").value = "";
    $("prompt").focus();
  }
  window.genserveRealtime.editPicture = editPicture;

  // ---- drawing ----
  function frameIntervalMs() {
    return state.settings ? 1000 / state.settings.fps : 0;
  }

  function draw(now) {
    const interval = frameIntervalMs();
    // Final frames arrive paced at fps; drawing at most one per interval (minus slack for the
    // display's own refresh) absorbs network jitter without dropping or bunching frames.
    const playing = state.finals.length > 0 || now - state.lastFinalDrawnAt < 2 * interval;
    if (state.finals.length && now - state.lastFinalDrawnAt >= interval - 8) {
      const frame = state.finals.shift();
      ctx.drawImage(frame.bitmap, 0, 0, canvas.width, canvas.height);
      frame.bitmap.close();
      state.lastFinalDrawnAt = now;
      stats.finalsDrawn += 1;
      stats.finalDrawTimes.push(now);
      state.drawTimes.push(now);
      $("frames-shown").textContent = `${stats.finalsDrawn}`;
    } else if (state.preview && !state.preview.drawn && !playing) {
      // Previews are smaller than the output (a latent projection): scale them up.
      ctx.drawImage(state.preview.bitmap, 0, 0, canvas.width, canvas.height);
      state.preview.drawn = true;
      stats.previewsDrawn += 1;
      state.drawTimes.push(now);
    }
    while (state.drawTimes.length && now - state.drawTimes[0] > 1000) state.drawTimes.shift();
    requestAnimationFrame(draw);
  }

  function updateReadouts() {
    $("render-fps").textContent = `${state.drawTimes.length}`;
    if (state.frameBytes.length) {
      const avg = mean(state.frameBytes);
      $("frame-bytes").textContent = avg >= 1024 ? `${(avg / 1024).toFixed(1)} KB` : `${avg} B`;
    }
    if (state.decodeMs.length) $("decode-time").textContent = `${mean(state.decodeMs).toFixed(1)} ms`;
  }

  // ---- small helpers ----
  function pushWindow(list, value, size) {
    list.push(value);
    if (list.length > size) list.shift();
  }

  function mean(list) {
    return Math.round(list.reduce((a, b) => a + b, 0) / list.length * 10) / 10;
  }

  function setStage(text, fraction) {
    $("stage").textContent = text;
    if (fraction !== undefined) $("progress").value = fraction;
  }

  function showError(text) {
    const box = $("error");
    box.textContent = text;
    box.hidden = false;
  }

  function clearError() {
    $("error").hidden = true;
    $("error").textContent = "";
  }

  function updateButtons() {
    const open = Boolean(state.ws && state.ws.readyState === WebSocket.OPEN);
    const busy = state.running || state.awaitingStart;
    $("start").disabled = !open || busy;
    $("stop").disabled = !open || !busy;
    $("send-prompt").disabled = !open || !state.running || !$("continuous").checked
      || state.mode !== "video";
    $("reset").disabled = $("send-prompt").disabled || !state.settings
      || !state.settings.streaming;
  }

  // ---- wiring ----
  $("controls").addEventListener("submit", (event) => {
    event.preventDefault();
    start();
  });
  $("stop").addEventListener("click", stop);
  $("send-prompt").addEventListener("click", sendPrompt);
  $("reset").addEventListener("click", newScene);
  $("record").addEventListener("click", toggleRecording);
  $("model").addEventListener("change", applyModelDefaults);
  $("mode").addEventListener("change", () => setMode($("mode").value));
  $("input-image").addEventListener("change", onPicturesChosen);
  $("input-mask").addEventListener("change", onMaskChosen);
  $("strength").addEventListener("input", () => {
    $("strength-value").textContent = $("strength").value;
  });
  $("continuous").addEventListener("change", updateButtons);
  $("quality").addEventListener("input", () => {
    $("quality-value").textContent = $("quality").value;
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      if (state.running && $("continuous").checked) sendPrompt();
      else if (!state.running) start();
    }
  });
  ctx.fillStyle = "#000";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  setInterval(updateReadouts, 250);
  requestAnimationFrame(draw);
  boot();

  // A server without a diffusion model has no realtime socket and nothing to draw: the page
  // opens on the chat panel alone. When /v1/models cannot be read, the socket's retries
  // report the server's state.
  async function boot() {
    let kinds = null;
    try {
      const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
      const response = await fetch("/v1/models", { headers });
      if (response.ok) kinds = (await response.json()).data.map((m) => m.kind);
    } catch (err) {
      kinds = null;
    }
    if (kinds !== null && !kinds.includes("diffusion")) {
      document.body.dataset.panel = "chat";
      document.title = "genserve · chat";
      $("subtitle").textContent = "chat";
      setConnection("open", "chat only");
      return;
    }
    connect();
  }
})();
