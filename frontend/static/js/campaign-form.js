// The campaign form: show the config fields of the chosen architecture, the
// hyperparameters of the chosen optimizer, and the inner optimizer's only in local mode. The server reads only those, so hiding
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

  // The inner optimizer's settings mean something in local mode only.
  const mode = form.querySelector("select[name=training_mode]");
  function showMode() {
    if (!mode) return;
    for (const box of form.querySelectorAll('[data-field^="inner_"]')) box.hidden = mode.value !== "local";
  }
  // Rules between settings, from the settings table (settings_table.RULES): while one holds, the form refuses
  // another value of its field (and says why). Choosing its condition moves the field from its default, and only
  // from its default, so no choice of the organizer is undone.
  const rules = JSON.parse(document.getElementById("setting-rules").textContent);
  function fitRules() {
    for (const rule of rules) {
      const [name, value] = rule.when;
      const chosen = form.querySelector(`[name=${name}]`);
      const input = form.querySelector(`input[name=${rule.field}]`);
      if (!chosen || chosen.value !== value || !input || input.disabled) continue;
      if (Number(input.value) === Number(rule.default)) input.value = String(rule.value);
    }
  }

  // Pretrained weights decide the model: choosing them fills in their architecture and sizes.
  const pretrained = form.querySelector("select[name=pretrained]");
  const pretrainedConfigs = JSON.parse(document.getElementById("pretrained-configs").textContent);
  function fillFromPretrained() {
    const chosen = pretrained && pretrainedConfigs[pretrained.value];
    if (!chosen) return;
    architecture.value = chosen.architecture;
    showArchitecture();
    for (const [name, value] of Object.entries(chosen.config)) {
      const input = form.querySelector(`[name="${chosen.architecture}__${name}"]`);
      if (!input || input.disabled) continue;
      if (input.type === "checkbox") input.checked = Boolean(value);
      else input.value = Array.isArray(value) ? value.join(", ") : String(value);
    }
  }

  architecture.addEventListener("change", showArchitecture);
  if (pretrained) pretrained.addEventListener("change", fillFromPretrained);
  optimizer.addEventListener("change", showOptimizer);
  if (mode) mode.addEventListener("change", showMode);
  for (const name of new Set(rules.map((rule) => rule.when[0]))) {
    const chosen = form.querySelector(`[name=${name}]`);
    if (chosen) chosen.addEventListener("change", fitRules);
  }
  showArchitecture();
  showOptimizer();
  showMode();
})();
