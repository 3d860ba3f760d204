"""Which registry families browser compute can take: each one's graph exported and gated in a small config.

    python -m crowdtrain.browser.report                 # every family
    python -m crowdtrain.browser.report mlp resnet      # some

Prints one ``bench:`` line per family: the ratio of the graph's error to
PyTorch fp32's (both against fp64), both errors, the verdict and its reason.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from .gate import GateResult, check_browser_compute

# Small configs of every family, with a microbatch each: seconds to export and gate on one core.
SMALL_CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "mlp": ({"in_dim": 64, "hidden": [128, 128], "classes": 10}, 16),
    "gpt": ({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}, 4),
    "llama": (
        {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "block_size": 16,
        },
        4,
    ),
    "gpt2": ({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}, 4),
    "resnet": ({"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "image_size": 32}, 4),
    "vit": (
        {
            "patch_size": 8,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": 32,
        },
        4,
    ),
}


def bench_line(result: GateResult, seconds: float) -> str:
    onnx = f"{result.onnx.relative:.2e} (max abs {result.onnx.max_abs:.1e})" if result.onnx else "none"
    pytorch = f"{result.pytorch.relative:.2e} (max abs {result.pytorch.max_abs:.1e})" if result.pytorch else "none"
    verdict = "pass" if result.passed else "fail"
    return (
        f"bench: browser_gate_{result.model_name}={result.ratio:.3g} (ort err {onnx}, torch fp32 err {pytorch}, "
        f"{verdict}, {seconds:.1f} s, {result.reason})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m crowdtrain.browser.report",
        description="Export and gate the gradient graph of each registry family in a small config.",
    )
    parser.add_argument("families", nargs="*", help=f"families to gate (default: all of {', '.join(SMALL_CONFIGS)})")
    args = parser.parse_args(argv)
    # The exporter warns, on every export, of torchvision operators it cannot register: not news here.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    unknown = sorted(set(args.families) - set(SMALL_CONFIGS))
    if unknown:
        parser.error(f"no small config for {', '.join(unknown)}; known: {', '.join(SMALL_CONFIGS)}")
    for family in args.families or list(SMALL_CONFIGS):
        config, microbatch = SMALL_CONFIGS[family]
        started = time.perf_counter()
        _, result = check_browser_compute(family, config, microbatch)
        print(bench_line(result, time.perf_counter() - started), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
