// The shard coverage card (campaigns/_coverage.html): poll /api/campaigns/<id>/coverage every 10 s
// (the server caches it for as long) and draw one square per shard, or per cell of shards on a large
// dataset, its colours stacked by how many of its samples are in each state. Each square is a button
// with the numbers in its aria-label and title; clicking or focusing one writes them in the details line.
// One square takes the Tab key at a time; the arrow keys, Home and End move between squares.
(function () {
  "use strict";

  const map = document.getElementById("coverage-map");
  if (!map || !map.dataset.url) return;
  const card = map.closest(".coverage") || document;
  const details = card.querySelector("[data-coverage-details]");
  const note = card.querySelector("[data-coverage-note]");
  const POLL_MS = 10000;
  const DENSE_FROM = 400; // squares; past this many they shrink so the map stays a screen or two tall
  const EMPTY = "No shards leased yet in this epoch.";

  let data = null;
  let selected = -1; // index of the square whose numbers the details line shows
  let current = 0; // index of the square that takes the Tab key

  const number = (n) => Number(n).toLocaleString();

  function cellName(cell) {
    return cell.first_shard === cell.last_shard
      ? `shard ${cell.first_shard}`
      : `shards ${cell.first_shard}–${cell.last_shard}`;
  }

  function names(cell) {
    const list = (cell.volunteers || []).map((v) => v.name);
    if (!list.length) return "";
    return list.join(", ") + (cell.more_volunteers ? ` and ${cell.more_volunteers} more` : "");
  }

  // "800 done, 224 leased": the states a cell has samples in, most advanced first.
  function parts(cell) {
    return data.states.flatMap((state, i) => (cell.counts[i] ? [`${number(cell.counts[i])} ${state}`] : []));
  }

  // "shard 12: 800 done, 224 leased; by alice, bob": the label screen readers read and the tooltip shows.
  function label(cell) {
    const by = names(cell);
    return `${cellName(cell)}: ${parts(cell).join(", ") || "no samples"}${by ? `; by ${by}` : ""}`;
  }

  function detailsText(cell) {
    let text = `${cellName(cell)}, ${number(cell.samples)} samples: ${parts(cell).join(", ") || "none"}.`;
    const credited = (cell.volunteers || []).map((v) => `${v.name} (${number(v.samples)})`);
    if (credited.length) {
      text += ` Done by ${credited.join(", ")}${cell.more_volunteers ? ` and ${cell.more_volunteers} more` : ""}.`;
    }
    return text;
  }

  // The states stacked from the bottom, most advanced first; the colours are coverage.css's variables.
  function background(cell) {
    if (!cell.samples) return "";
    const stops = [];
    let at = 0;
    data.states.forEach((state, i) => {
      const n = cell.counts[i] || 0;
      if (!n) return;
      const from = (100 * at) / cell.samples;
      at += n;
      const to = (100 * at) / cell.samples;
      stops.push(`var(--cov-${state}) ${from.toFixed(2)}% ${to.toFixed(2)}%`);
    });
    return stops.length ? `linear-gradient(to top, ${stops.join(", ")})` : "";
  }

  function showDetails() {
    if (!details || !data) return;
    if (selected >= 0 && selected < data.cells.length) details.textContent = detailsText(data.cells[selected]);
    else details.textContent = "Select a square for its numbers and volunteers.";
  }

  function select(index) {
    if (!data || index < 0 || index >= data.cells.length) return;
    const squares = map.children;
    if (selected >= 0 && squares[selected]) squares[selected].setAttribute("aria-pressed", "false");
    if (squares[current]) squares[current].tabIndex = -1;
    selected = current = index;
    squares[index].setAttribute("aria-pressed", "true");
    squares[index].tabIndex = 0;
    showDetails();
  }

  function draw(feed) {
    data = feed;
    const cells = feed.cells || [];
    // Rebuild only when the number of squares changes (a new epoch keeps the dataset, so rarely).
    if (map.children.length !== cells.length) {
      const fragment = document.createDocumentFragment();
      cells.forEach((_, i) => {
        const square = document.createElement("button");
        square.type = "button";
        square.className = "coverage-cell";
        square.dataset.index = String(i);
        square.tabIndex = -1;
        square.setAttribute("aria-pressed", "false");
        fragment.appendChild(square);
      });
      map.replaceChildren(fragment);
      map.classList.toggle("coverage-dense", cells.length > DENSE_FROM);
      if (selected >= cells.length) selected = -1;
      current = Math.max(0, Math.min(current, cells.length - 1));
    }
    cells.forEach((cell, i) => {
      const square = map.children[i];
      const text = label(cell);
      square.setAttribute("aria-label", text);
      square.title = text;
      square.dataset.state = cell.state;
      square.style.background = background(cell);
      square.tabIndex = i === current ? 0 : -1;
      square.setAttribute("aria-pressed", i === selected ? "true" : "false");
    });
    for (const node of card.querySelectorAll("[data-coverage-count]")) {
      node.textContent = number((feed.totals || {})[node.dataset.coverageCount] || 0);
    }
    if (note) {
      const lines = [];
      if (!feed.touched) lines.push(EMPTY);
      if (feed.shards_per_cell > 1) {
        lines.push(
          `Each square is ${feed.shards_per_cell} consecutive shards: this dataset has ${number(feed.num_shards)},` +
            ` and the map draws at most ${number(feed.max_cells)} squares.`,
        );
      }
      note.textContent = lines.join(" ");
      note.hidden = !lines.length;
    }
    for (const node of card.querySelectorAll("[data-coverage-epoch]")) node.textContent = feed.epoch;
    map.setAttribute("aria-label", `Shards of epoch ${feed.epoch}`);
    map.setAttribute("aria-busy", "false");
    showDetails();
  }

  // How many squares fit on one row now (the map wraps, so it depends on the screen).
  function columns() {
    const squares = map.children;
    if (!squares.length) return 1;
    const top = squares[0].offsetTop;
    let n = 0;
    while (n < squares.length && squares[n].offsetTop === top) n += 1;
    return Math.max(n, 1);
  }

  map.addEventListener("click", (event) => {
    const square = event.target.closest(".coverage-cell");
    if (square) select(Number(square.dataset.index));
  });
  map.addEventListener("focusin", (event) => {
    const square = event.target.closest(".coverage-cell");
    if (square) select(Number(square.dataset.index));
  });
  map.addEventListener("keydown", (event) => {
    if (!data || !data.cells.length) return;
    const last = data.cells.length - 1;
    const moves = {
      ArrowRight: current + 1,
      ArrowLeft: current - 1,
      ArrowDown: current + columns(),
      ArrowUp: current - columns(),
      Home: 0,
      End: last,
    };
    if (!(event.key in moves)) return;
    event.preventDefault();
    const next = Math.max(0, Math.min(last, moves[event.key]));
    map.children[next].focus(); // focusin selects it
  });

  async function poll() {
    // A tab in the background asks nothing; it catches up when it is shown again.
    if (!document.hidden) {
      try {
        const response = await fetch(map.dataset.url, { headers: { Accept: "application/json" } });
        if (response.ok) draw(await response.json());
        else if (details && !data) details.textContent = `The coverage feed answered ${response.status}; retrying.`;
      } catch (err) {
        // The site restarting is no reason to stop watching: try again at the next tick.
      }
    }
    window.setTimeout(poll, POLL_MS);
  }

  poll();
})();
