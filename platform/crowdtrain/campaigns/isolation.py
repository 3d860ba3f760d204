"""Cross-origin isolation of the browser tab's page, worker and onnxruntime-web files (issue 36).

onnxruntime-web runs its threads on SharedArrayBuffer, which a browser gives only to a cross-origin
isolated page: COOP ``same-origin`` and COEP ``require-corp`` on the page *and* on the worker's
scripts, or a session asking for threads hangs with no error. The tab computes on one thread today;
the headers keep more threads a setting away. Imported by settings (whitenoise's hook): no Django here.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}
# The tab's static files: its bundles and onnxruntime-web's (`make charts`, frontend/scripts/build-tab.mjs).
TAB_STATIC_PREFIXES = ("build/tab-", "build/ort/")


def isolate_tab_static(headers: MutableMapping[str, str], path: str, url: str) -> None:
    """WHITENOISE_ADD_HEADERS_FUNCTION: the tab's worker and onnxruntime-web files get ISOLATION_HEADERS.

    ``headers`` is a ``wsgiref.headers.Headers``: item assignment only, no ``update``.
    """
    relative = url.split("/static/", 1)[-1]
    if relative.startswith(TAB_STATIC_PREFIXES):
        for name, value in {**ISOLATION_HEADERS, "Cross-Origin-Resource-Policy": "same-origin"}.items():
            headers[name] = value
