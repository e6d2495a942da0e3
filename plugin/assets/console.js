// The console's few behaviours: the ? help overlay, keyboard navigation
// (g r runs, g i inbox, g h history, / search) and the deadline countdowns. Everything
// else is server-rendered HTML that htmx swaps in from SSE streams.
(function () {
  "use strict";
  var help = document.getElementById("help");
  function openHelp() { if (help && !help.open) { help.showModal(); } }
  document.addEventListener("click", function (e) {
    if (e.target.closest && e.target.closest(".help-button")) { openHelp(); }
  });
  var pendingG = false;
  document.addEventListener("keydown", function (e) {
    var t = e.target;
    var typing = t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT" || t.isContentEditable);
    if (typing || e.ctrlKey || e.metaKey || e.altKey) { return; }
    if (e.key === "?") { e.preventDefault(); openHelp(); return; }
    if (e.key === "/") {
      var s = document.getElementById("search");
      if (s) { e.preventDefault(); s.focus(); }
      return;
    }
    if (pendingG) {
      pendingG = false;
      if (e.key === "r") { location.href = "/"; }
      if (e.key === "i") { location.href = "/approvals"; }
      if (e.key === "h") { location.href = "/history"; }
      return;
    }
    if (e.key === "g") { pendingG = true; setTimeout(function () { pendingG = false; }, 1500); }
  });
  function short(s) {
    if (s <= 0) { return "expired"; }
    if (s < 120) { return "in " + s + "s"; }
    if (s < 7200) { return "in " + Math.floor(s / 60) + "m " + (s % 60) + "s"; }
    if (s < 172800) { return "in " + Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m"; }
    return "in " + Math.floor(s / 86400) + "d";
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("time.countdown").forEach(function (el) {
      var at = Date.parse(el.getAttribute("datetime"));
      if (!isNaN(at)) { el.textContent = short(Math.round((at - now) / 1000)); }
    });
  }
  setInterval(tick, 1000);
  // Live or not: the element holding a stream says so (and the tests wait on it).
  document.addEventListener("htmx:sseOpen", function (e) { e.target.setAttribute("data-live", "open"); });
  document.addEventListener("htmx:sseError", function (e) { e.target.setAttribute("data-live", "closed"); });
})();
