// Leaderboard rows move live: the table's data-feed URL returns the same page as JSON; polled every 5 s
// while the tab is visible, so a volunteer sees their row move soon after their agent's work commits.
(function () {
  "use strict";
  const table = document.querySelector("table.board[data-feed]");
  if (!table) return;
  const body = table.querySelector("tbody");
  const rank = document.querySelector("[data-testid=my-rank]");
  const credit = document.querySelector("[data-testid=my-credit]");

  function cell(text, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    return td;
  }

  function render(board) {
    const rows = board.rows.map((r) => {
      const tr = document.createElement("tr");
      if (r.me) { tr.className = "board-mine"; tr.setAttribute("aria-current", "true"); }
      const name = cell("");
      if (r.url) {
        const a = document.createElement("a");
        a.href = r.url;
        a.textContent = r.name;
        name.appendChild(a);
      } else {
        name.textContent = r.name;
      }
      tr.append(cell(String(r.rank)), name, cell(r.credit.toFixed(3), "num"));
      return tr;
    });
    if (rows.length) body.replaceChildren(...rows);
    if (board.me) {
      if (rank) rank.textContent = String(board.me.rank);
      if (credit) credit.textContent = board.me.credit.toFixed(3);
    }
  }

  async function poll() {
    if (document.visibilityState === "visible") {
      try {
        const response = await fetch(table.dataset.feed, {headers: {Accept: "application/json"}});
        if (response.ok) render(await response.json());
      } catch (e) { /* the next poll tries again */ }
    }
    setTimeout(poll, 5000);
  }
  setTimeout(poll, 5000);
})();
