// genserve chat panel: talk to a served LLM or vision-language model through
// /v1/chat/completions (streamed). An image can be dropped, pasted, picked from a file or
// taken from the last generated frame on the realtime canvas; it rides on the next message.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const apiKey = new URLSearchParams(location.search).get("api_key");
  const authHeaders = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};

  const state = {
    models: [],          // LLM model cards of /v1/models
    history: [],         // OpenAI messages of this conversation
    image: null,         // data URL attached to the next message
    busy: false,
    abort: null,
  };
  // For people and tests (the browser test reads them).
  const stats = { answers: [], errors: [], chunks: 0 };
  window.genserveChat = { state, stats };

  // ---- models ----
  async function loadModels() {
    let cards;
    try {
      const response = await fetch("/v1/models", { headers: authHeaders });
      const body = await response.json();
      if (!response.ok) throw new Error(errorText(body, response));
      cards = body.data.filter((m) => m.kind === "llm");
    } catch (err) {
      showError(`Could not list the chat models: ${err.message}`);
      return;
    }
    const select = $("chat-model");
    const previous = select.value;
    state.models = cards;
    // Vision models first: an image is what this panel adds.
    cards.sort((a, b) => takesImages(b) - takesImages(a));
    select.replaceChildren(...cards.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = takesImages(m) ? `${m.id} (text + image)` : `${m.id} (text)`;
      return option;
    }));
    if (cards.some((m) => m.id === previous)) select.value = previous;
    select.disabled = cards.length === 0;
    if (cards.length === 0) showError("This server serves no chat model.");
    updateControls();
  }

  function takesImages(card) {
    return Array.isArray(card.modalities) && card.modalities.includes("image");
  }

  function currentModel() {
    return state.models.find((m) => m.id === $("chat-model").value) || null;
  }

  // ---- the attached image ----
  function readImageFile(file) {
    if (!file) return;
    if (!file.type.startsWith("image/")) {
      showError(`${file.name || "That file"} is not an image (${file.type || "unknown type"}).`);
      return;
    }
    const reader = new FileReader();
    reader.onload = () => attachImage(reader.result);
    reader.onerror = () => showError(`Could not read ${file.name}: ${reader.error}`);
    reader.readAsDataURL(file);
  }

  function attachImage(dataUrl) {
    state.image = dataUrl;
    $("chat-image-preview").src = dataUrl;
    $("chat-attachment").hidden = false;
    hideError();
    updateControls();
  }

  function detachImage() {
    state.image = null;
    $("chat-attachment").hidden = true;
    $("chat-image-preview").removeAttribute("src");
    $("chat-file").value = "";
    updateControls();
  }

  function useLastFrame() {
    const realtime = window.genserveRealtime;
    const drawn = realtime && realtime.stats
      ? realtime.stats.finalsDrawn + realtime.stats.previewsDrawn : 1;
    if (!drawn) {
      showError("Nothing has been generated yet: start a generation, then take its frame.");
      return;
    }
    attachImage($("canvas").toDataURL("image/png"));
  }

  // ---- conversation ----
  function addMessage(role, text, image) {
    const item = document.createElement("li");
    item.className = `chat-${role}`;
    if (image) {
      const img = document.createElement("img");
      img.src = image;
      img.alt = "attached image";
      item.append(img);
    }
    const body = document.createElement("span");
    body.className = "chat-text";
    body.textContent = text;
    item.append(body);
    $("chat-log").append(item);
    item.scrollIntoView({ block: "end" });
    return body;
  }

  async function send(event) {
    event.preventDefault();
    const text = $("chat-input").value.trim();
    const model = currentModel();
    if (state.busy || !model || (!text && !state.image)) return;
    hideError();
    const content = [];
    if (state.image) content.push({ type: "image_url", image_url: { url: state.image } });
    if (text) content.push({ type: "text", text });
    const message = { role: "user", content: state.image ? content : text };
    addMessage("user", text, state.image);
    const messages = [...state.history, message];
    $("chat-input").value = "";
    detachImage();
    const answer = addMessage("assistant", "");
    answer.parentElement.dataset.state = "streaming";
    setBusy(true);
    let reply = "";
    try {
      reply = await streamChat(model.id, messages, (delta) => {
        reply += delta;
        answer.textContent = reply;
        stats.chunks += 1;
      });
      state.history = [...messages, { role: "assistant", content: reply }];
      stats.answers.push(reply);
      answer.parentElement.dataset.state = "done";
    } catch (err) {
      answer.parentElement.dataset.state = "failed";
      if (err.name === "AbortError") {
        answer.textContent = reply + " [stopped]";
      } else {
        answer.parentElement.remove();
        showError(err.message);
      }
    } finally {
      setBusy(false);
    }
  }

  // POST /v1/chat/completions with stream: true; calls onDelta with each piece of text and
  // returns the whole answer. Throws an Error carrying the server's message.
  async function streamChat(model, messages, onDelta) {
    state.abort = new AbortController();
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders },
      body: JSON.stringify({
        model, messages, stream: true,
        max_tokens: Number($("chat-max-tokens").value) || 256,
        temperature: Number($("chat-temperature").value) || 0,
      }),
      signal: state.abort.signal,
    });
    if (!response.ok) {
      let body = null;
      try { body = await response.json(); } catch (_) { /* not JSON */ }
      throw new Error(`${response.status}: ${errorText(body, response)}`);
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let text = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return text;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "the generation failed");
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            text += delta.content;
            onDelta(delta.content);
          }
        }
      }
    }
    return text;
  }

  function errorText(body, response) {
    return body && body.error && body.error.message ? body.error.message : response.statusText;
  }

  function clearChat() {
    if (state.abort) state.abort.abort();
    state.history = [];
    $("chat-log").replaceChildren();
    hideError();
  }

  // ---- page state ----
  function setBusy(busy) {
    state.busy = busy;
    $("chat-panel").dataset.state = busy ? "busy" : "idle";
    updateControls();
  }

  function updateControls() {
    const model = currentModel();
    $("chat-send").disabled = state.busy || !model;
    $("chat-stop").disabled = !state.busy;
    const hint = $("chat-hint");
    hint.hidden = !(state.image && model && !takesImages(model));
    hint.textContent = hint.hidden ? "" : `${model.id} reads text only; pick a model marked ` +
      "text + image to ask about the picture.";
  }

  function showError(message) {
    stats.errors.push(message);
    const box = $("chat-error");
    box.textContent = message;
    box.hidden = false;
  }

  function hideError() {
    $("chat-error").hidden = true;
  }

  // ---- wiring ----
  const drop = $("chat-drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    readImageFile(e.dataTransfer.files[0]);
  });
  document.addEventListener("paste", (e) => {
    const items = e.clipboardData ? [...e.clipboardData.items] : [];
    const item = items.find((i) => i.kind === "file" && i.type.startsWith("image/"));
    if (!item) return;  // plain text pastes go where they were aimed
    e.preventDefault();
    readImageFile(item.getAsFile());
  });
  $("chat-file").addEventListener("change", (e) => readImageFile(e.target.files[0]));
  $("chat-last-frame").addEventListener("click", useLastFrame);
  $("chat-remove-image").addEventListener("click", detachImage);
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("chat-stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("chat-clear").addEventListener("click", clearChat);
  $("chat-model").addEventListener("change", updateControls);
  loadModels();
})();
