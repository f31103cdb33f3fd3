// The console's only script: live progress of a replay run. The page shows
// the run as the database held it when it was rendered; this keeps it
// current, so a reload or a second tab shows the same numbers.
"use strict";
(function () {
  const run = document.getElementById("run");
  if (!run) {
    return;
  }
  const url = run.dataset.progress;
  const set = (id, text) => {
    const el = document.getElementById(id);
    if (el) {
      el.textContent = text;
    }
  };
  const poll = async () => {
    try {
      const response = await fetch(url, { credentials: "same-origin" });
      if (!response.ok) {
        return;
      }
      const p = await response.json();
      set("published", String(p.published));
      set("total", String(p.total));
      set("state", p.state);
      set("stop-reason", p.stopReason);
      if (p.state === "running") {
        setTimeout(poll, 1000);
      }
    } catch (e) {
      setTimeout(poll, 3000);
    }
  };
  poll();
})();
