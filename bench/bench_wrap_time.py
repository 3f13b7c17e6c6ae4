"""Import-to-first-step time of a parallelized transformers model: the seconds a fresh torchrun
worker spends importing torch, transformers and torchpp, building a tiny Llama, calling
``parallelize`` and running its first ``step`` (pp=2, zb-h1, 4 microbatches; or tp=2).

    python bench/bench_wrap_time.py --repeats 5            # launches torchrun 5 times per layout

Every repeat is a fresh pair of processes (imports are part of the time); rank 0's phases are
reported as the median and the spread (max - min) / median over repeats.
"""
from __future__ import annotations

import time

_START = time.perf_counter()  # before any import below: imports count

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"pp2": dict(tp=1, pp=2), "tp2": dict(tp=2, pp=1)}


def worker(layout: str) -> None:
    import torch

    import torchpp
    from torchpp.models import parallelize
    from transformers import LlamaConfig, LlamaForCausalLM

    imported = time.perf_counter()
    sizes = LAYOUTS[layout]
    state = torchpp.init_parallel(**sizes)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    built = time.perf_counter()
    model = parallelize(model, schedule="zb-h1", n_microbatches=4, state=state)
    wrapped = time.perf_counter()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    model.step(ids, labels=ids)
    stepped = time.perf_counter()
    if torch.distributed.get_rank() == 0:
        print("PHASES " + json.dumps({"import": imported - _START, "build": built - imported,
                                      "parallelize": wrapped - built, "first step": stepped - wrapped,
                                      "total": stepped - _START}), flush=True)


def launch(layout: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--worker", layout]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("PHASES ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"bench_wrap_time {layout}: worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("PHASES "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", nargs="*", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    runs = {layout: [] for layout in args.layouts}
    for _ in range(args.repeats):  # layouts interleaved, so load drift hits both alike
        for layout in args.layouts:
            runs[layout].append(launch(layout))
    for layout, samples in runs.items():
        cells = []
        for phase in samples[0]:
            values = [s[phase] for s in samples]
            median = statistics.median(values)
            cells.append(f"{phase} {median:.2f} s (spread {(max(values) - min(values)) / median:.0%})")
        print(f"{layout}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
