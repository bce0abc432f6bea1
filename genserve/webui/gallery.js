// The gallery of finished images: app.js sends each one as a "genserve:image" event (a canvas
// and what made it); this keeps them as PNG blobs, newest first, with a large view, a
// download link and an "Edit" button that hands the picture back to app.js's edit mode.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const MAX_ITEMS = 48;  // older images are dropped (and their blob URLs revoked)
  const items = [];      // {url, detail}, newest first

  function fileName(detail) {
    const model = detail.model.replace(/[^a-zA-Z0-9._-]/g, "_");
    return `genserve-${model}-${detail.seed}.png`;
  }

  function caption(detail) {
    return `${detail.prompt} · ${detail.model} (${detail.task}) · ${detail.width}x${detail.height}`
      + ` · seed ${detail.seed} · ${detail.steps} steps`;
  }

  function add(detail, blob) {
    const url = URL.createObjectURL(blob);
    const item = { url, detail };
    items.unshift(item);
    const li = document.createElement("li");
    const view = document.createElement("button");
    view.type = "button";
    view.className = "view";
    view.title = "View";
    const img = document.createElement("img");
    img.src = url;
    img.alt = detail.prompt;
    view.append(img);
    view.addEventListener("click", () => show(item));
    const text = document.createElement("p");
    text.textContent = caption(detail);
    const download = document.createElement("a");
    download.className = "download";
    download.href = url;
    download.download = fileName(detail);
    download.textContent = "Download";
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "edit";
    edit.textContent = "Edit";
    edit.addEventListener("click", () => editItem(item));
    li.append(view, text, download, edit);
    $("gallery").prepend(li);
    $("gallery-empty").hidden = true;
    while (items.length > MAX_ITEMS) {
      URL.revokeObjectURL(items.pop().url);
      $("gallery").lastElementChild.remove();
    }
  }

  function show(item) {
    $("lightbox-image").src = item.url;
    $("lightbox-caption").textContent = caption(item.detail);
    const link = $("lightbox").querySelector("a.download");
    link.href = item.url;
    link.download = fileName(item.detail);
    $("lightbox").showModal();
  }

  async function editItem(item) {
    const blob = await (await fetch(item.url)).blob();
    const reader = new FileReader();
    reader.onload = () => window.genserveRealtime.editPicture(reader.result);
    reader.readAsDataURL(blob);
  }

  window.addEventListener("genserve:image", (event) => {
    const detail = event.detail;
    detail.canvas.toBlob((blob) => {
      if (blob) add(detail, blob);
    }, "image/png");
  });
  $("lightbox-close").addEventListener("click", () => $("lightbox").close());
})();
