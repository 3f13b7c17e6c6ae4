"""Model sweep: every transformers model type whose config carries a tensor- and a pipeline-
parallel plan, wrapped by torchpp.models.parallelize at tp=2 and at pp=2, against the
unwrapped model in float64 (loss, logits, every gradient, one SGD step; rtol 1e-9).

    python bench/model_sweep.py                      # all types, writes docs/models.md
    python bench/model_sweep.py --types llama qwen3  # some types, prints only

Runs on 2 spawned gloo ranks (tests/harness.py's pool: a hang or crash of one type fails that
type only). A type fails with the first line of its error on rank 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

TIMEOUT_S = 120


def _run(check: str, model_type: str) -> str:
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from torchpp.testing import model_checks

    return getattr(model_checks, check)(model_type)


def _first_line(error: str) -> str:
    """The exception line of the first rank's traceback (what a reader needs to know)."""
    lines = [line for line in error.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("AssertionError", "torchpp", "RuntimeError", "ValueError", "TypeError", "KeyError",
                            "AttributeError", "IndexError", "NotImplementedError", "PlanError")) or ": " in line and \
                line.split(":")[0].endswith(("Error", "Exception")):
            return line.strip()[:300]
    return (lines[-1] if lines else error).strip()[:300]


def sweep(types, pool_of):
    from torchpp.testing.tiny_models import UNBUILDABLE

    rows = []
    for model_type in types:
        row = {"type": model_type}
        if model_type in UNBUILDABLE:
            row["tp"] = row["pp"] = f"not built: {UNBUILDABLE[model_type]}"
            rows.append(row)
            print(f"{model_type:40s} skipped: {UNBUILDABLE[model_type]}", flush=True)
            continue
        for key, check in (("tp", "check_tp"), ("pp", "check_pp")):
            start = time.monotonic()
            try:
                result = pool_of(2).run(_run, check, model_type, timeout=TIMEOUT_S)
                row[key] = "pass"
                row[key + "_detail"] = result[-1]
            except AssertionError as error:
                row[key] = "FAIL: " + _first_line(str(error).split("\n", 1)[-1])
            row[key + "_s"] = time.monotonic() - start
        print(f"{model_type:40s} tp=2 {row['tp'][:90]:90s} pp=2 {row['pp'][:90]}", flush=True)
        rows.append(row)
    return rows


def write_table(rows, path: str, seconds: float) -> None:
    import torch
    import transformers

    both = [r for r in rows if r["tp"] == "pass" and r["pp"] == "pass"]
    lines = [
        "# Models: the plan-driven wrapping of every transformers type with plans",
        "",
        "`bench/model_sweep.py` builds a tiny random model of each transformers model type whose config carries both",
        "`base_model_tp_plan` and `base_model_pp_plan` (`torchpp.testing.tiny_models`: 4 layers of each kind the type",
        "has, 4 heads, vocabulary 97, float64), wraps it with `torchpp.models.parallelize` at tp=2 (the model called",
        "as before: loss, full logits) and at pp=2 (zb-h1, 4 microbatches, `model.step`), and compares loss, logits,",
        "every gradient and one SGD step with the unwrapped model (rtol 1e-9). A failure shows its error.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}: **{len(both)} of {len(rows)} types pass "
        f"both**; sweep time {seconds / 60:.1f} min on this 2-core machine.",
        "",
        "    python bench/model_sweep.py",
        "",
        "| model type | tp=2 | pp=2 (zb-h1) |",
        "|---|---|---|",
    ]
    for row in rows:
        cells = [row["tp"], row["pp"]]
        lines.append(f"| {row['type']} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", help="model types (default: every type with both plans)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "models.md"))
    args = parser.parse_args()
    from harness import RankPools

    from torchpp.testing.tiny_models import causal_lm_types

    types = args.types or causal_lm_types()
    pools = RankPools()
    start = time.monotonic()
    try:
        rows = sweep(types, pools)
    finally:
        pools.close()
    seconds = time.monotonic() - start
    passed = sum(r["tp"] == "pass" and r["pp"] == "pass" for r in rows)
    print(f"{passed} of {len(rows)} types pass at tp=2 and pp=2 ({seconds / 60:.1f} min)")
    if not args.types:
        write_table(rows, args.out, seconds)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
