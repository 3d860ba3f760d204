// The campaign form: show the config fields of the chosen architecture and the
// hyperparameters of the chosen optimizer. The server reads only those, so hiding
// the others changes nothing it checks; without JavaScript every field shows.
(function () {
  "use strict";

  const form = document.getElementById("campaign-form");
  if (!form) return;
  const architecture = form.querySelector("select[name=architecture]");
  const optimizer = form.querySelector("select[name=optimizer]");
  // {optimizer: [its hyperparameters]}, from the optimizer registry (CampaignForm.optimizer_field_map).
  const optimizerFields = JSON.parse(document.getElementById("optimizer-fields").textContent);
  const tunable = [...new Set(Object.values(optimizerFields).flat())];

  function showArchitecture() {
    for (const set of form.querySelectorAll("fieldset.config-set")) {
      const chosen = set.dataset.architecture === architecture.value;
      set.hidden = !chosen;
    }
  }

  function showOptimizer() {
    const used = optimizerFields[optimizer.value] || tunable;
    for (const name of tunable) {
      const box = form.querySelector(`[data-field="${name}"]`);
      if (box) box.hidden = !used.includes(name);
    }
  }

  architecture.addEventListener("change", showArchitecture);
  optimizer.addEventListener("change", showOptimizer);
  showArchitecture();
  showOptimizer();
})();
