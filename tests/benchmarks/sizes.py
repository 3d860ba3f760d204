"""The model-size phase: a Llama from the registry at ~10M, ~100M and ~350M parameters, swarm against plain PyTorch.

    python -m tests.benchmarks.sizes                    # or: make bench
    python -m tests.benchmarks.sizes --sizes 10m,100m --steps 4

Each size runs plain PyTorch (one process, two threads: the machine's two
cores) and then the swarm on the same model, batch and machine: the embedded
site, two aggregators and two one-thread CPU agents. Same workload as the
issue that asked for it: byte-level samples of the standard library's source,
context 128, global batch 16, microbatch 4, AdamW, fp32, staleness 1.

Lines, per size (``_10m``, ``_100m``, ``_350m``):

- ``size_efficiency``: the swarm's steady samples/s over plain PyTorch's;
- ``aggregator_bytes_per_param``: the larger aggregator's peak RSS (VmHWM)
  over the parameters of its slice; ``aggregator_steady_bytes_per_param``,
  the median of its resident set (VmRSS, read once a second while the steps
  run) over the same, and ``aggregator_anon_bytes_per_param`` of its
  anonymous part (RssAnon: not the spool's file pages, which the kernel takes
  back under pressure); ``aggregator_slice_bytes_per_param``, the steady
  resident set less an idle aggregator's (what the slice costs, without the
  fixed cost of PyTorch and the process); ``agent_peak_bytes_per_param`` and
  ``plain_peak_bytes_per_param``: peak RSS over the model's parameters;
- ``time_to_first_step_s``: agents started against a ready site and
  aggregators, to the first committed step; ``plain_time_to_first_step_s``,
  the plain loop's process started to its first step (the floor: one step's
  compute, model build included);
- ``bytes_up_per_sample``, ``bytes_down_per_sample``: what the agents'
  done reports say their links carried, over the committed samples;
- ``wasted_upload_fraction``: gradient uploads the aggregators accepted that
  no committed step used (a backup or original that lost, a rolled-back
  step), over all they accepted.

On a machine with CUDA, ``gpu_size_efficiency_100m`` and ``bf16_speedup_100m``
compare a CUDA agent with mixed precision on and off; elsewhere they say
``skipped`` with the reason. A size whose estimated memory exceeds the
machine's is skipped with its estimate.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
for _folder in (
    REPO_ROOT / "platform",
    REPO_ROOT / "agent" / "src",
    REPO_ROOT / "deploy" / "launcher",
):  # as manage.py does
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from crowdtrain_launcher import Swarm, get_json  # noqa: E402

from .figures import figure_line  # noqa: E402
from .w1 import steady_rate  # noqa: E402

logger = logging.getLogger("tests.benchmarks.sizes")

BLOCK = 128
BATCH, MICROBATCH = 16, 4
CORPUS_BYTES = 4 << 20
# Llama configs of about the named size on a byte vocabulary (counted by the registry when the bench runs).
SIZES: dict[str, dict[str, Any]] = {
    "10m": {"num_hidden_layers": 12, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4},
    "100m": {"num_hidden_layers": 14, "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12},
    "350m": {"num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16},
}
# Peak bytes per model parameter the swarm needs at once here, measured at 100M (9ea99c9): two agents at
# about 33 each, and two aggregators at about 30 per parameter of their half. What decides whether a size fits.
SWARM_BYTES_PER_PARAM = 2 * 33 + 30


def config_of(size: str) -> dict[str, Any]:
    c = SIZES[size]
    return {**c, "num_key_value_heads": c["num_attention_heads"], "block_size": BLOCK, "vocab_size": 256}


def param_count(size: str) -> int:
    from crowdtrain_agent.models import get_model

    return get_model("llama").param_count(config_of(size))


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes; 0 once it is gone."""
    return _status_bytes(pid, "VmHWM:")


def resident(pid: int) -> tuple[int, int]:
    """The process's resident set now (VmRSS) and its anonymous part (RssAnon), in bytes; 0 once it is gone.

    The rest of the resident set is pages of files (the spool's mapped
    gradients and versions), which the kernel takes back under pressure.
    """
    return _status_bytes(pid, "VmRSS:"), _status_bytes(pid, "RssAnon:")


def _status_bytes(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------ plain PyTorch

PLAIN = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch
    sys.path[:0] = [{platform!r}, {agent!r}]
    from crowdtrain_agent.models import get_model
    torch.set_num_threads(2)
    config, steps, warmup, device = {config!r}, {steps}, {warmup}, {device!r}
    entry = get_model("llama")
    model = entry.build(config, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    corpus = torch.tensor(list(open({corpus!r}, "rb").read()), dtype=torch.long)
    samples = corpus[: (len(corpus) // {sample}) * {sample}].view(-1, {sample}).to(device)
    times, at = [], 0
    for step in range(steps + warmup):
        optimizer.zero_grad(set_to_none=True)
        for lo in range(0, {batch}, {micro}):
            rows = samples[at : at + {micro}]
            at += {micro}
            with torch.autocast(device, dtype=torch.bfloat16, enabled={autocast}):
                loss = entry.loss_sum(model, rows[:, :-1], rows[:, 1:]) / {batch}
            loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        if step == 0:
            first_step_s = time.time() - {started!r}
    rate = {batch} * steps / (times[-1] - times[warmup - 1])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({{"samples_per_s": rate, "peak": peak, "first_step_s": first_step_s}}))
    """
)


def idle_aggregator_bytes() -> int:
    """The resident set of a process that imported what an aggregator imports and holds nothing: its fixed cost.

    Mostly PyTorch's own (libraries and the memory its import sets up), the
    same at any size; what a slice adds is the steady resident set less this.
    """
    code = (
        f"import sys; sys.path[:0] = [{str(REPO_ROOT / 'platform')!r}, {str(REPO_ROOT / 'agent' / 'src')!r}]\n"
        "import crowdtrain_backbone.__main__, crowdtrain_backbone.server\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')][0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024


def corpus_file() -> Path:
    """The corpus the swarm's dataset is cut from (``seed_run``'s stdlib kind), for the plain loop to read."""
    path = REPO_ROOT / "var" / "bench" / "sizes-corpus.bin"
    if not path.exists():
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crowdtrain.settings")
        import django

        django.setup()
        from crowdtrain.datasets.sharding import stdlib_corpus

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(stdlib_corpus(CORPUS_BYTES))
    return path


def plain_pytorch(size: str, steps: int, warmup: int, device: str = "cpu", autocast: bool = False) -> dict[str, float]:
    """Samples/s, peak RSS and the seconds from its start to its first step of the same training in one
    two-thread process, in a child of its own."""
    code = PLAIN.format(
        platform=str(REPO_ROOT / "platform"), agent=str(REPO_ROOT / "agent" / "src"), config=config_of(size),
        steps=steps, warmup=warmup, corpus=str(corpus_file()), sample=BLOCK + 1, batch=BATCH, micro=MICROBATCH,
        device=device, autocast=autocast, started=time.time(),
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the swarm


@dataclass(frozen=True)
class SwarmFigures:
    samples_per_s: float
    first_step_s: float
    aggregator_peak: int  # bytes, the larger of the two
    aggregator_steady: int  # bytes, the median of the larger aggregator's resident set sampled after the first step
    aggregator_anon: int  # bytes, the same for its anonymous memory (RssAnon)
    aggregator_params: int  # parameters of that aggregator's slice
    agent_peak: int
    bytes_up_per_sample: float
    bytes_down_per_sample: float
    wasted_upload_fraction: float


def spec(size: str, steps: int, agents: int = 2, mixed_precision: bool = True) -> dict[str, Any]:
    return {
        "campaigns": [{
            "name": f"llama {size}", "architecture": "llama", "model_config": config_of(size),
            "dataset": {"kind": "stdlib", "bytes": CORPUS_BYTES, "sample_len": BLOCK + 1, "shard_bytes": 1 << 20},
            "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0}, "target_batch_size": BATCH,
            "microbatch_size": MICROBATCH, "codec": "fp32", "staleness": 1, "max_steps": steps,
            "checkpoint_every": 1000, "validate_every": 0, "num_aggregators": 2, "check_fraction": 0.0, "seed": 0,
            "mixed_precision": mixed_precision,
        }],
        "aggregators": ["agg-1", "agg-2"],
        "agents": [f"agent-{i + 1}" for i in range(agents)],
    }  # fmt: skip


def _accepted_uploads(aggregator_url: str) -> float:
    text = subprocess.run(["curl", "-s", f"{aggregator_url}/metrics"], capture_output=True, text=True).stdout
    for line in text.splitlines():
        if line.startswith("crowdtrain_backbone_uploads_total") and 'result="accepted"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wasted_fraction(committed_leases: int, slices: int, accepted_uploads: float) -> float:
    """Uploads the aggregators accepted that no committed step used, over all they accepted (0 with none).

    Each lease of a committed step uploads one gradient per slice; any other accepted upload (a backup or an
    original that lost, a lease of a step rolled back) was work thrown away.
    """
    if accepted_uploads <= 0:
        return 0.0
    return max(0.0, 1.0 - committed_leases * slices / accepted_uploads)


def run_swarm(
    run_dir: Path,
    size: str,
    steps: int,
    warmup: int,
    *,
    agents: int = 2,
    device: str = "cpu",
    mixed_precision: bool = True,
    site_env: dict[str, str] | None = None,
) -> SwarmFigures:
    env = {"CROWDTRAIN_VAR_DIR": str(run_dir / "var"), "CROWDTRAIN_TICKET_KEY": secrets.token_bytes(32).hex(),
           "CROWDTRAIN_DEBUG": "false", **(site_env or {})}  # fmt: skip
    with Swarm(run_dir, env=env) as swarm:
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(spec(size, steps, agents, mixed_precision)))
        seed = json.loads(swarm.manage("seed_run", "--migrate", "--spec", str(spec_path), timeout_s=600))
        campaign_id = seed["campaigns"][0]
        site = swarm.start_site()
        aggregators = swarm.start_aggregators(site, seed["aggregators"], timeout_s=300)
        for url in aggregators:
            swarm.wait_until(lambda url=url: get_json(f"{url}/healthz")["slices"], 300, "an aggregator's slice")
        time.sleep(0.5)
        started = time.monotonic()
        for name, token in seed["agents"].items():
            swarm.start_agent(site, token=token, name=name, threads=1, campaign_id=campaign_id, device=device)
        progress = f"{site.url}/api/campaigns/{campaign_id}/progress"
        swarm.wait_until(lambda: get_json(progress)["committed_steps"] >= 1, 1800, "the first committed step", 0.1)
        first_step_s = time.monotonic() - started
        rss: dict[str, list[tuple[int, int]]] = {name: [] for name in seed["aggregators"]}
        pids = {child.name: child.pid for child in swarm.children if child.name in rss}

        def applied_all() -> bool:
            for name, pid in pids.items():  # steady state: every step after the first, read once a second
                rss[name].append(resident(pid))
            return get_json(progress)["version"] >= steps

        swarm.wait_until(applied_all, 3600, f"{steps} applied steps", 1.0)
        accepted = sum(_accepted_uploads(url) for url in aggregators)
        peaks = {child.name: peak_rss(child.pid) for child in swarm.children}
        dump = json.loads(swarm.manage("dump_run", "--campaign", str(campaign_id)))
    rate = steady_rate(dump["steps"][:steps], warmup)
    slices = dump["slices"]
    aggregator_peaks = [peaks.get(name, 0) for name in seed["aggregators"]]
    widest = max(s["end"] - s["start"] for s in slices)
    committed_leases = sum(len(step["leases"]) for step in dump["steps"])
    network = dump.get("network") or {}
    samples = max(1, int(network.get("samples") or 0))
    return SwarmFigures(
        samples_per_s=rate,
        first_step_s=first_step_s,
        aggregator_peak=max(aggregator_peaks),
        aggregator_steady=max(int(statistics.median(r for r, _ in v)) if v else 0 for v in rss.values()),
        aggregator_anon=max(int(statistics.median(a for _, a in v)) if v else 0 for v in rss.values()),
        aggregator_params=widest,
        agent_peak=max(peaks.get(name, 0) for name in seed["agents"]),
        bytes_up_per_sample=float(network.get("bytes_up") or 0) / samples,
        bytes_down_per_sample=float(network.get("bytes_down") or 0) / samples,
        wasted_upload_fraction=wasted_fraction(committed_leases, len(slices), accepted),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.sizes", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10m,100m,350m", help="comma-separated, of 10m, 100m, 350m")
    parser.add_argument("--steps", type=int, default=5, help="steps per swarm phase (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the rates (default 1)")
    parser.add_argument("--site-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra site setting, e.g. CROWDTRAIN_LEASE_TARGET_S=30 (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    site_env = dict(item.split("=", 1) for item in args.site_env if "=" in item)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = REPO_ROOT / "var" / "bench" / "sizes"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        count = param_count(size)
        print(figure_line(f"params_{size}", float(count)), flush=True)
        need, have = count * SWARM_BYTES_PER_PARAM, available_bytes()
        if need > have:
            why = (f"the swarm would need about {need / 2**30:.1f} GiB at {SWARM_BYTES_PER_PARAM} bytes per "
                   f"parameter; {have / 2**30:.1f} GiB available")  # fmt: skip
            print(f"bench: size_efficiency_{size}=skipped ({why})", flush=True)
            continue
        plain = plain_pytorch(size, args.steps, args.warmup)
        idle_aggregator = idle_aggregator_bytes()
        swarm = run_swarm(root / size, size, args.steps, args.warmup, site_env=site_env)
        lines = [
            figure_line(f"plain_samples_per_s_{size}", plain["samples_per_s"]),
            figure_line(f"swarm_samples_per_s_{size}", swarm.samples_per_s),
            figure_line(f"size_efficiency_{size}", swarm.samples_per_s / plain["samples_per_s"]),
            figure_line(f"aggregator_bytes_per_param_{size}", swarm.aggregator_peak / swarm.aggregator_params),
            figure_line(f"aggregator_steady_bytes_per_param_{size}", swarm.aggregator_steady / swarm.aggregator_params),
            figure_line(f"aggregator_anon_bytes_per_param_{size}", swarm.aggregator_anon / swarm.aggregator_params),
            figure_line(
                f"aggregator_slice_bytes_per_param_{size}",
                (swarm.aggregator_steady - idle_aggregator) / swarm.aggregator_params,
            ),
            figure_line(f"agent_peak_bytes_per_param_{size}", swarm.agent_peak / count),
            figure_line(f"plain_peak_bytes_per_param_{size}", plain["peak"] / count),
            figure_line(f"time_to_first_step_s_{size}", swarm.first_step_s),
            figure_line(f"plain_time_to_first_step_s_{size}", plain["first_step_s"]),
            figure_line(f"bytes_up_per_sample_{size}", swarm.bytes_up_per_sample),
            figure_line(f"bytes_down_per_sample_{size}", swarm.bytes_down_per_sample),
            figure_line(f"wasted_upload_fraction_{size}", swarm.wasted_upload_fraction),
        ]
        for line in lines:
            print(line, flush=True)
    gpu_lines()
    return 0


def gpu_lines() -> None:
    import torch

    if not torch.cuda.is_available():
        reason = "skipped (PyTorch sees no CUDA device on this machine)"
        print(f"bench: gpu_size_efficiency_100m={reason}", flush=True)
        print(f"bench: bf16_speedup_100m={reason}", flush=True)
        return
    # One CUDA agent against plain PyTorch on the same GPU, mixed precision on and off.
    root = REPO_ROOT / "var" / "bench" / "sizes-gpu"
    shutil.rmtree(root, ignore_errors=True)
    plain = plain_pytorch("100m", 10, 2, device="cuda", autocast=True)
    rates = {}
    for mixed in (True, False):
        figures = run_swarm(root / ("bf16" if mixed else "fp32"), "100m", 10, 2, agents=1, device="cuda",
                            mixed_precision=mixed)  # fmt: skip
        rates[mixed] = figures.samples_per_s
    print(figure_line("gpu_plain_samples_per_s_100m", plain["samples_per_s"]), flush=True)
    print(figure_line("gpu_size_efficiency_100m", rates[True] / plain["samples_per_s"]), flush=True)
    print(figure_line("bf16_speedup_100m", rates[True] / rates[False]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
