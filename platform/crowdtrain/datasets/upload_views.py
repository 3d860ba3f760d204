"""The upload API the page's uploader calls; the rules and the stored chunks are ``uploads``'.

POST /datasets/uploads                      {"filename", "size", "format", ...} -> 201 {"id", ...}
GET  /datasets/uploads/<id>                 -> {"received": N, ...}: the resume point
PUT  /datasets/uploads/<id>/chunk?offset=N  body: the bytes N .. N+len-1
POST /datasets/uploads/<id>/complete        -> 202, queues the sharding task
POST /datasets/tokenizers                   body: a tokenizer.json -> 201 {"sha256", "vocab_size"}
"""

from __future__ import annotations

import json
import logging
import re
from uuid import UUID

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_http_methods

from crowdtrain.campaigns.organizers import is_organizer

from .models import Upload
from .permissions import visible_uploads
from .uploads import UploadError, append_chunk, complete_upload, create_upload, describe, store_uploaded_tokenizer

logger = logging.getLogger(__name__)


# ASCII digits only (str.isdigit also takes "²", which int() refuses), and no longer than any file.
_BYTE_COUNT = re.compile(r"[0-9]{1,19}")


def _error(exc: UploadError) -> JsonResponse:
    return JsonResponse({"error": str(exc), **exc.extra}, status=exc.status)


def _guard(request: HttpRequest) -> JsonResponse | None:
    """JSON answers for a script, not a redirect to the log-in page."""
    if not request.user.is_authenticated:
        return JsonResponse({"error": "log in first"}, status=401)
    if not is_organizer(request.user):
        return JsonResponse({"error": "only organizers can upload datasets; ask for the role first"}, status=403)
    return None


@require_http_methods(["POST"])
def upload_create(request: HttpRequest) -> JsonResponse:
    if (refused := _guard(request)) is not None:
        return refused
    try:
        body = json.loads(request.body or b"{}")
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nesting deeper than the parser goes
        return JsonResponse({"error": "the request body must be a JSON object"}, status=400)
    if not isinstance(body, dict):
        return JsonResponse({"error": "the request body must be a JSON object"}, status=400)
    try:
        upload = create_upload(request.user, body)
    except UploadError as exc:
        return _error(exc)
    logger.info("upload %s started by %s: %s, %d bytes", upload.pk, request.user.pk, upload.filename, upload.size)
    return JsonResponse(describe(upload), status=201)


@require_http_methods(["POST"])
def tokenizer_upload(request: HttpRequest) -> JsonResponse:
    """POST /datasets/tokenizers, the tokenizer.json as the body: answers its sha256 for an upload's ``tokenizer``."""
    if (refused := _guard(request)) is not None:
        return refused
    cap = settings.CROWDTRAIN_MAX_TOKENIZER_BYTES
    declared = request.META.get("CONTENT_LENGTH") or "0"
    try:
        if _BYTE_COUNT.fullmatch(declared) and int(declared) > cap:
            raise UploadError(f"a tokenizer file may hold at most {cap} bytes, got {declared}", status=413, limit=cap)
        answer = store_uploaded_tokenizer(request.read(cap + 1))
    except UploadError as exc:
        return _error(exc)
    logger.info("tokenizer %s (%d tokens) uploaded by %s", answer["sha256"][:12], answer["vocab_size"], request.user.pk)
    return JsonResponse(answer, status=201)


def _own_upload(request: HttpRequest, upload_id: UUID) -> Upload:
    upload = visible_uploads(request.user).filter(pk=upload_id).first()
    if upload is None:  # someone else's upload is as unknown as a missing one
        raise UploadError("unknown upload", status=404)
    return upload


@require_http_methods(["PUT"])
def upload_chunk(request: HttpRequest, upload_id: UUID) -> JsonResponse:
    if (refused := _guard(request)) is not None:
        return refused
    limit = settings.CROWDTRAIN_UPLOAD_CHUNK_BYTES
    try:
        upload = _own_upload(request, upload_id)
        raw_offset = request.GET.get("offset", "")
        if not _BYTE_COUNT.fullmatch(raw_offset):
            raise UploadError(f"offset must be a byte position (a whole number), got {raw_offset[:40]!r}")
        declared = request.META.get("CONTENT_LENGTH") or "0"
        if _BYTE_COUNT.fullmatch(declared) and int(declared) > limit:
            raise UploadError(f"a chunk may hold at most {limit} bytes, got {declared}", status=413, limit=limit)
        # request.read, not request.body: body is capped by DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB).
        data = request.read(limit + 1)
        if len(data) > limit:
            raise UploadError(f"a chunk may hold at most {limit} bytes", status=413, limit=limit)
        upload = append_chunk(upload, int(raw_offset), data)
    except UploadError as exc:
        return _error(exc)
    return JsonResponse(describe(upload))


@require_http_methods(["GET"])
def upload_status(request: HttpRequest, upload_id: UUID) -> JsonResponse:
    if (refused := _guard(request)) is not None:
        return refused
    try:
        return JsonResponse(describe(_own_upload(request, upload_id)))
    except UploadError as exc:
        return _error(exc)


@require_http_methods(["POST"])
def upload_complete(request: HttpRequest, upload_id: UUID) -> JsonResponse:
    if (refused := _guard(request)) is not None:
        return refused
    try:
        upload = complete_upload(_own_upload(request, upload_id))
    except UploadError as exc:
        return _error(exc)
    return JsonResponse(describe(upload), status=202)
