// Render the math that pymdownx.arithmatex (generic mode) left in the page:
// <span class="arithmatex">\(...\)</span> and <div class="arithmatex">\[...\]</div>.
// KaTeX itself is served from this site (assets/katex/), never from a CDN.
(function () {
  function render(root) {
    if (typeof katex === "undefined") return;
    root.querySelectorAll(".arithmatex").forEach(function (el) {
      if (el.dataset.nsRendered) return;
      var tex = el.textContent.trim();
      var display = el.tagName === "DIV" || tex.startsWith("\\[");
      tex = tex.replace(/^\\[([]/, "").replace(/\\[)\]]$/, "");
      katex.render(tex, el, { displayMode: display, throwOnError: false });
      el.dataset.nsRendered = "1";
    });
  }
  if (typeof document$ !== "undefined") {
    document$.subscribe(function (doc) { render(doc.body || document.body); });
  } else {
    document.addEventListener("DOMContentLoaded", function () { render(document.body); });
  }
})();
