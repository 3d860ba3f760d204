"""What a campaign's model downloads hold: safetensors weights of a validated version plus a JSON config.

The exportable versions are those the validation task stored (every
``validate_every`` steps and at the finish, see ``validation``): the site
keeps its own copy of their parameters in default storage, so an export
works whether or not the aggregators still hold that version, and the
weights are exactly the ones whose validation loss the page shows.
"""

from __future__ import annotations

import json
import zipfile
from typing import IO, Any

from django.conf import settings
from django.core.files.storage import default_storage
from django.http import HttpRequest
from django.urls import reverse

from crowdtrain.datasets.models import shard_storage_name
from crowdtrain_agent.models.hf import CONFIGS, pretrained_files

from .agent_wheel import wheel_url
from .models import Campaign, ValidationResult

SNIPPET = (
    "# pip install {pip_spec}\n"
    "from crowdtrain_agent.models import load_exported\n"
    'model = load_exported("model.safetensors", "config.json")'
)


class ExportRequestError(ValueError):
    """A version the request cannot export; ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def exports(campaign: Campaign) -> list[ValidationResult]:
    """The versions with stored weights, newest first."""
    return list(campaign.validation_results.exclude(weights="").order_by("-version"))


def pick_export(campaign: Campaign, raw_version: str | None) -> ValidationResult:
    """The stored version named by ``?version=``, or the newest one when it is left out.

    Raises:
        ExportRequestError: for a version that is not an integer (400) or has no stored weights (404).
    """
    stored = exports(campaign)
    if raw_version in (None, ""):
        if not stored:
            raise ExportRequestError(
                "nothing to export yet: weights are stored with each validation loss, "
                f"every {campaign.validate_every} steps and when the campaign finishes",
                404,
            )
        return stored[0]
    try:
        version = int(raw_version)
    except ValueError:
        raise ExportRequestError(f"version must be an integer, got {raw_version!r}", 400) from None
    for result in stored:
        if result.version == version:
            return result
    known = ", ".join(str(r.version) for r in stored[:10]) or "none yet"
    raise ExportRequestError(f"version {version} was not exported; exported versions: {known}", 404)


def export_config(campaign: Campaign, result: ValidationResult) -> dict[str, Any]:
    """What ``config.json`` holds: enough to rebuild the model (``load_exported``) and to know what it is."""
    return {
        "format": "crowdtrain-export/1",
        "campaign": {"id": campaign.pk, "name": campaign.name},
        "architecture": campaign.architecture,
        "model_config": campaign.model_config,
        "param_count": campaign.param_count,
        "version": result.version,
        "step": result.version,  # version v holds the parameters after v optimizer steps
        "val_loss": result.loss,
        "val_samples": result.num_samples,
        "dataset": {
            "name": campaign.dataset.name,
            "kind": campaign.dataset.kind,
            "sample_len": campaign.dataset.sample_len,
        },
        "optimizer": campaign.optimizer,
        "seed": campaign.seed,
    }


def export_context(campaign: Campaign, request: HttpRequest) -> dict[str, Any]:
    """For the campaign page's export card (``campaigns/_export.html``).

    The snippet installs the agent from where the join page does (no package index serves it).
    """
    pip_spec = settings.CROWDTRAIN_AGENT_PIP_SPEC or wheel_url(request)
    return {
        "versions": [
            {
                "version": r.version,
                "loss": r.loss,
                "weights_url": f"{reverse('campaign-export', args=[campaign.pk])}?version={r.version}",
                "config_url": f"{reverse('campaign-export-config', args=[campaign.pk])}?version={r.version}",
                "transformers_url": f"{reverse('campaign-export-transformers', args=[campaign.pk])}?version={r.version}"
                if pretrained_files_known(campaign)
                else "",
            }
            for r in exports(campaign)
        ],
        "snippet": SNIPPET.format(pip_spec=pip_spec),
        "transformers_snippet": (LM_SNIPPET if campaign.dataset.kind in ("text", "tokens") else IMAGE_SNIPPET)
        if pretrained_files_known(campaign)
        else "",
    }


def pretrained_files_known(campaign: Campaign) -> bool:
    """Whether the campaign's architecture is one of the library's (its export loads with ``from_pretrained``)."""
    return campaign.architecture in CONFIGS


LM_SNIPPET = (
    "# pip install transformers; unzip the download (it holds model/)\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
    'model = AutoModelForCausalLM.from_pretrained("model")\n'
    'tokenizer = AutoTokenizer.from_pretrained("model")'
)
IMAGE_SNIPPET = (
    "# pip install transformers; unzip the download (it holds model/)\n"
    "from transformers import AutoImageProcessor, AutoModelForImageClassification\n"
    'model = AutoModelForImageClassification.from_pretrained("model")\n'
    'processor = AutoImageProcessor.from_pretrained("model")  # scales 0..255 pixels to -1..1, as training did\n'
    'logits = model(**processor(images=image, return_tensors="pt")).logits'
)
COPY_CHUNK = 1 << 20


def transformers_folder(campaign: Campaign, result: ValidationResult, out: IO[bytes]) -> None:
    """Write a zip of a ``transformers`` folder (``config.json``, ``model.safetensors``, the dataset's tokenizer or
    an image processor) to ``out``; the stored weights are copied in chunks, never held in memory whole.

    Raises:
        ExportRequestError: the campaign's architecture is not one of the library's (409).
    """
    dataset = campaign.dataset
    tokenizer = None
    if dataset.tokenizer_sha256:
        with default_storage.open(shard_storage_name(dataset.tokenizer_sha256), "rb") as fh:
            tokenizer = fh.read()
    files = pretrained_files(
        campaign.architecture, campaign.model_config, tokenizer_json=tokenizer, labels=dataset.labels or None
    )
    if not files:
        raise ExportRequestError(
            f"{campaign.architecture} is not a transformers architecture; download model.safetensors and "
            "config.json instead and load them with crowdtrain_agent.models.load_exported",
            409,
        )
    with zipfile.ZipFile(out, "w") as folder, default_storage.open(result.weights, "rb") as weights:
        for name, data in sorted(files.items()):
            folder.writestr(f"model/{name}", data, compress_type=zipfile.ZIP_DEFLATED)
        with folder.open("model/model.safetensors", "w", force_zip64=True) as target:
            target.write(pt_header(weights))
            while chunk := weights.read(COPY_CHUNK):
                target.write(chunk)


def pt_header(weights: IO[bytes]) -> bytes:
    """The safetensors header of ``weights`` (read past it) with ``format: pt`` in its metadata.

    ``from_pretrained`` refuses a file whose metadata does not name its framework; the tensors' offsets are
    relative to the end of the header, so the bytes after it are copied as they are. Headers are padded
    with spaces to a multiple of 8 bytes, as the format's writers do.
    """
    length = int.from_bytes(weights.read(8), "little")
    header = json.loads(weights.read(length))
    header["__metadata__"] = {**header.get("__metadata__", {}), "format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
