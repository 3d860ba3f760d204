// Copy buttons: <button data-copy="ID"> copies the text of the element with that id.
// Also opens the instructions for the visitor's operating system first.
(function () {
  "use strict";

  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return;
    }
    // Plain-HTTP sites (a local run) have no clipboard API: fall back to a selected textarea.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    const ok = document.execCommand("copy");
    document.body.removeChild(area);
    if (!ok) throw new Error("copy refused");
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    const source = document.getElementById(button.dataset.copy);
    if (!source) return;
    const label = button.textContent;
    try {
      await copyText(source.textContent);
      button.textContent = "Copied";
    } catch (err) {
      button.textContent = "Select and copy by hand";
    }
    setTimeout(() => { button.textContent = label; }, 2000);
  });

  const platform = ((navigator.userAgentData && navigator.userAgentData.platform) || navigator.platform || "").toLowerCase();
  const key = platform.includes("win") ? "win" : platform.includes("mac") ? "mac" : platform.includes("linux") ? "linux" : null;
  const sections = document.querySelectorAll("details[data-platform]");
  if (key && sections.length) {
    sections.forEach((section) => { section.open = section.dataset.platform === key; });
  }
})();
