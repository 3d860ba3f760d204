// Dataset uploads in chunks (File.slice), resumable after a reload, and live sharding progress.
// The upload id is kept in localStorage under the file's name, size and date and the choices that
// shape the dataset, so choosing the same file with the same choices again asks the site how much it
// already has (GET) and sends only the rest.
(function () {
  "use strict";

  const RETRIES = 5;

  function csrfToken(form) {
    const input = form.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  function formatBytes(n) {
    const units = ["bytes", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  // A JSON request; network failures and 5xx answers are retried with backoff, 4xx are not.
  async function request(url, options) {
    for (let attempt = 0; ; attempt += 1) {
      let response;
      try {
        response = await fetch(url, Object.assign({ credentials: "same-origin" }, options));
      } catch (error) {
        if (attempt >= RETRIES) throw new Error("the network failed: " + error.message);
        await sleep(500 * 2 ** attempt);
        continue;
      }
      if (response.status >= 500 && attempt < RETRIES) {
        await sleep(500 * 2 ** attempt);
        continue;
      }
      let data = {};
      try { data = await response.json(); } catch (error) { data = { error: "the site answered " + response.status }; }
      return { status: response.status, data: data };
    }
  }

  function setupUploader(form) {
    const fileInput = form.querySelector("input[type=file]");
    const formatSelect = form.querySelector("select[name=format]");
    const errorBox = form.querySelector("[data-upload-error]");
    const noteBox = form.querySelector("[data-upload-note]");
    const progressBox = form.querySelector("[data-upload-progress]");
    const bar = progressBox.querySelector("progress");
    const barText = progressBox.querySelector("[data-upload-progress-text]");
    const button = form.querySelector("button[type=submit]");
    const createUrl = form.dataset.createUrl;
    const maxBytes = Number(form.dataset.maxBytes);
    const headers = { "X-CSRFToken": csrfToken(form) };

    const tokenizerSelect = form.querySelector("select[name=tokenizer]");
    const tokenizerFile = form.querySelector("input[name=tokenizer_file]");
    const maxTokenizerBytes = Number(form.dataset.maxTokenizerBytes);
    const textual = () => formatSelect.value === "text" || formatSelect.value === "jsonl";

    function showFormatFields() {
      form.querySelectorAll("[data-for-format]").forEach((field) => {
        field.hidden = !field.dataset.forFormat.split(" ").includes(formatSelect.value);
      });
      if (!tokenizerSelect) return;  // the pretrained weights' page has one format and no tokenizer
      form.querySelectorAll("[data-for-tokenizer]").forEach((field) => {
        field.hidden = !textual() || field.dataset.forTokenizer !== tokenizerSelect.value;
      });
      form.querySelector("[data-sample-unit]").textContent = tokenizerSelect.value ? "(tokens)" : "(bytes)";
    }
    formatSelect.addEventListener("change", showFormatFields);
    if (tokenizerSelect) tokenizerSelect.addEventListener("change", showFormatFields);
    fileInput.addEventListener("change", () => {
      const file = fileInput.files[0];
      if (!file || formatSelect.options.length < 2) return;
      if (/\.npz$/i.test(file.name)) formatSelect.value = "npz";
      else if (/\.jsonl?$/i.test(file.name)) formatSelect.value = "jsonl";
      else if (/\.(zip|tar|tgz|tar\.gz|tar\.bz2|tar\.xz)$/i.test(file.name)) formatSelect.value = "images";
      else formatSelect.value = "text";
      showFormatFields();
    });
    showFormatFields();

    // The tokenizer field of the upload: "" (bytes), "train", or the sha256 the site answers for a tokenizer.json.
    async function tokenizerChoice() {
      if (!textual() || !tokenizerSelect || !tokenizerSelect.value) return { tokenizer: "" };
      if (!["train", "file"].includes(tokenizerSelect.value)) return { tokenizer: tokenizerSelect.value };
      if (tokenizerSelect.value === "train") {
        return { tokenizer: "train", vocab_size: Number(form.querySelector("[name=vocab_size]").value) };
      }
      const file = tokenizerFile.files[0];
      if (!file) throw new Error("Choose the tokenizer.json file, or another tokenizer option.");
      if (file.size > maxTokenizerBytes) {
        throw new Error("The tokenizer file is " + formatBytes(file.size) + ", over the limit of " + formatBytes(maxTokenizerBytes) + ".");
      }
      note("Checking the tokenizer…");
      const answer = await request(form.dataset.tokenizerUrl, {
        method: "POST",
        headers: Object.assign({ "Content-Type": "application/json" }, headers),
        body: file,
      });
      if (answer.status !== 201) throw new Error(answer.data.error || "The tokenizer was refused.");
      note("Tokenizer accepted: " + answer.data.vocab_size + " tokens.");
      return { tokenizer: answer.data.sha256 };
    }

    function fail(message) {
      errorBox.textContent = message;
      errorBox.hidden = false;
      button.disabled = false;
    }

    function note(message) {
      noteBox.textContent = message;
      noteBox.hidden = !message;
    }

    function showProgress(done, total) {
      progressBox.hidden = false;
      bar.value = total ? done / total : 0;
      barText.textContent = Math.floor((100 * done) / Math.max(1, total)) + "%";
      bar.setAttribute("aria-valuetext", formatBytes(done) + " of " + formatBytes(total));
    }

    // Every choice that shapes what the site makes of the file: the same file with another sample length,
    // vocabulary, tokenizer file, JSON field or image size is another upload, never the old one resumed.
    function shape() {
      const value = (name) => {
        const field = form.querySelector("[name=" + name + "]");
        return field ? field.value : "";
      };
      const parts = { format: formatSelect.value };
      if (textual()) {
        parts.sample_len = value("sample_len");
        parts.tokenizer = tokenizerSelect ? tokenizerSelect.value : "";
        if (parts.tokenizer === "train") parts.vocab_size = value("vocab_size");
        const chosen = tokenizerFile && tokenizerFile.files[0];
        if (parts.tokenizer === "file" && chosen) parts.tokenizer_file = [chosen.name, chosen.size, chosen.lastModified].join("/");
      }
      if (formatSelect.value === "jsonl") parts.text_field = value("text_field");
      if (formatSelect.value === "images") parts.image_size = value("image_size");
      return JSON.stringify(parts);
    }

    // An upload the site still holds for this very file, or null.
    async function resumable(key) {
      const id = localStorage.getItem(key);
      if (!id) return null;
      const answer = await request(createUrl + "/" + id, { method: "GET" });
      if (answer.status !== 200) {
        localStorage.removeItem(key);
        return null;
      }
      return answer.data;
    }

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      errorBox.hidden = true;
      note("");
      const file = fileInput.files[0];
      if (!file) return fail("Choose a file to upload.");
      if (file.size === 0) return fail("The file is empty; choose a file with data in it.");
      if (file.size > maxBytes) return fail("The file is " + formatBytes(file.size) + ", over the limit of " + formatBytes(maxBytes) + ".");
      button.disabled = true;
      const key = ["crowdtrain-upload", file.name, file.size, file.lastModified, shape()].join(":");

      let upload = await resumable(key);
      if (upload && upload.received > 0) note("Resuming: the site already has " + formatBytes(upload.received) + ".");
      if (!upload) {
        const body = {
          filename: file.name,
          size: file.size,
          format: formatSelect.value,
          name: form.querySelector("[name=name]").value,
        };
        if (textual()) {
          body.sample_len = Number(form.querySelector("[name=sample_len]").value);
          try {
            Object.assign(body, await tokenizerChoice());
          } catch (error) {
            return fail(error.message);
          }
        }
        if (formatSelect.value === "jsonl") body.text_field = form.querySelector("[name=text_field]").value;
        if (formatSelect.value === "images") body.image_size = Number(form.querySelector("[name=image_size]").value);
        const answer = await request(createUrl, {
          method: "POST",
          headers: Object.assign({ "Content-Type": "application/json" }, headers),
          body: JSON.stringify(body),
        });
        if (answer.status !== 201) return fail(answer.data.error || "The upload could not start.");
        upload = answer.data;
        localStorage.setItem(key, upload.id);
      }

      // Send chunk after chunk from the site's resume point; a 409 names the right offset.
      let offset = upload.received;
      const chunkBytes = upload.chunk_bytes || Number(form.dataset.chunkBytes);
      showProgress(offset, file.size);
      while (upload.state === "receiving" && offset < file.size) {
        const answer = await request(createUrl + "/" + upload.id + "/chunk?offset=" + offset, {
          method: "PUT",
          headers: Object.assign({ "Content-Type": "application/octet-stream" }, headers),
          body: file.slice(offset, offset + chunkBytes),
        });
        if (answer.status === 409 && answer.data.expected_offset !== undefined) {
          offset = answer.data.expected_offset;
          continue;
        }
        if (answer.status !== 200) return fail(answer.data.error || "A chunk was refused.");
        offset = answer.data.received;
        showProgress(offset, file.size);
      }

      note("All bytes sent; splitting the file into shards…");
      const done = await request(createUrl + "/" + upload.id + "/complete", { method: "POST", headers: headers });
      if (done.status !== 202) return fail(done.data.error || "The upload could not be completed.");
      localStorage.removeItem(key);
      window.location.assign(done.data.page_url || done.data.dataset_url);
    });
  }

  // The dataset page: poll the status until sharding is over.
  function setupStatus(box) {
    const url = box.dataset.statusUrl;
    const progress = box.querySelector("[data-progress]");
    function field(name) { return box.querySelector("[data-field=" + name + "]"); }

    async function poll() {
      const answer = await request(url, { method: "GET" });
      if (answer.status !== 200) return;
      const s = answer.data;
      const badge = field("status");
      badge.textContent = s.status;
      badge.className = "badge dataset-status-" + s.status;
      box.dataset.state = s.status;
      progress.querySelector("progress").value = s.progress;
      field("percent").textContent = Math.floor(100 * s.progress) + "%";
      progress.hidden = s.status === "ready" || s.status === "failed";
      field("error").textContent = s.error;
      field("error").hidden = !s.error;
      // Fields this page shows (a dataset's counts; pretrained weights have fewer), kept live.
      ["stage", "num_samples", "num_validation_samples", "train_shards", "validation_shards", "param_count"]
        .forEach((name) => {
          if (field(name) && s[name] !== undefined) field(name).textContent = s[name];
        });
      if (field("size_bytes")) field("size_bytes").textContent = formatBytes(s.size_bytes);
      document.querySelectorAll("[data-when-ready]").forEach((el) => { el.hidden = s.status !== "ready"; });
      if (s.status !== "ready" && s.status !== "failed") setTimeout(poll, 1000);
      // The facts only a finished dataset has (its tokenizer, classes, skipped files) come with the page itself.
      else if (s.tokenizer || s.classes || s.skipped_count || s.architecture) window.location.reload();
    }
    if (box.dataset.state !== "ready" && box.dataset.state !== "failed") poll();
  }

  document.querySelectorAll("[data-upload-form]").forEach(setupUploader);
  document.querySelectorAll("[data-dataset-status]").forEach(setupStatus);
})();
