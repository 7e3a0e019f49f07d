// Lockgate console: copy buttons and the engine's live fragment. No inline script anywhere
// (the CSP allows scripts from this origin only).
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  for (const button of document.querySelectorAll("[data-copy]")) {
    button.addEventListener("click", async () => {
      const text = document.getElementById(button.dataset.copy).textContent;
      try {
        await navigator.clipboard.writeText(text);
        button.textContent = "Copied";
      } catch (e) {
        button.textContent = "Select and copy";
      }
    });
  }
  for (const box of document.querySelectorAll("[data-poll]")) {
    const every = Number(box.dataset.every) || 2000;
    const refresh = async () => {
      try {
        const r = await fetch(box.dataset.poll, {credentials: "same-origin", headers: {"Accept": "text/html"}});
        if (r.ok) {
          box.innerHTML = await r.text();   // the server's own, autoescaped fragment
          box.dataset.refreshed = String(Date.now());
          box.dataset.count = String((Number(box.dataset.count) || 0) + 1);
        }
      } finally {
        setTimeout(refresh, every);
      }
    };
    setTimeout(refresh, every);
  }
});
