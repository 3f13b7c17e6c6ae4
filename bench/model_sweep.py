"""Model sweep: every transformers model type whose config carries a tensor- and a pipeline-
parallel plan, wrapped by torchpp.models.parallelize at tp=2, at pp=2 and at cp=2, against the
unwrapped model in float64 (loss, logits, every gradient, one SGD step; rtol 1e-9); and every
causal-LM type without plans, wrapped with plan="auto".

    python bench/model_sweep.py                          # all types, writes docs/models.md
    python bench/model_sweep.py --types llama qwen3      # some types, prints only
    python bench/model_sweep.py --auto --types gpt2      # plan="auto" on some types
    python bench/model_sweep.py --slice 0 4 --rows r.jsonl   # a quarter of both tables, rows kept
    python bench/model_sweep.py --from-rows r*.jsonl     # docs/models.md from kept rows

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
# Fresh ranks after this many types: each check's groups are destroyed after it (_run), but a
# model type can leave other state in a rank (patched classes, import side effects).
TYPES_PER_POOL = 8
# How a cp=2 check's error starts where torchpp refused what a shard of the sequence cannot run.
REFUSALS = ("NotImplementedError: torchpp", "ValueError: torchpp.parallelize", "torchpp.tensor_parallel.sharding.PlanError")


def _run(check: str, model_type: str, plan=None) -> str:
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    import torchpp
    from torchpp.testing import model_checks

    outcome = getattr(model_checks, check)(model_type, plan=plan)
    torchpp.destroy_parallel()  # the check's groups (each holds threads) go before the next check's
    return outcome


def _first_line(error: str) -> str:
    """The exception line of the first rank's traceback (what a reader needs to know)."""
    lines = [line for line in error.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.rstrip().endswith(":") and i + 1 < len(lines):  # the message starts on the next line
            line = f"{line.rstrip()} {lines[i + 1].strip()}"
        if line.startswith(("AssertionError", "torchpp", "RuntimeError", "ValueError", "TypeError", "KeyError",
                            "AttributeError", "IndexError", "NotImplementedError", "PlanError")) or ": " in line and \
                line.split(":")[0].endswith(("Error", "Exception")):
            return line.strip()[:300]
    return (lines[-1] if lines else error).strip()[:300]


def sweep(types, pool_of, plan=None, rows_path=None):
    import json

    from torchpp.testing.tiny_models import UNBUILDABLE

    rows = []
    for done, model_type in enumerate(types):
        if done and done % TYPES_PER_POOL == 0:
            pool_of.close()
        row = {"type": model_type, "table": "auto" if plan == "auto" else "plans"}
        if model_type in UNBUILDABLE:
            row["tp"] = row["pp"] = f"not built: {UNBUILDABLE[model_type]}"
            row["cp"] = "-"
            print(f"{model_type:40s} skipped: {UNBUILDABLE[model_type]}", flush=True)
        else:
            _check(row, model_type, pool_of, plan)
            print(f"{model_type:40s} tp=2 {row['tp'][:60]:60s} pp=2 {row['pp'][:60]:60s} cp=2 {row.get('cp', '')[:60]} "
                  f"{_split_cell(row)}", flush=True)
        rows.append(row)
        if rows_path:
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def _check(row, model_type: str, pool_of, plan) -> None:
    """Fills the row's tp and pp results (and seconds) for one type."""
    from torchpp.testing.tiny_models import NOT_PIPELINED

    for key, check in (("tp", "check_tp"), ("pp", "check_pp"), ("cp", "check_cp")):
        if key == "pp" and model_type in NOT_PIPELINED:
            row["pp"] = f"not pipelined: {NOT_PIPELINED[model_type]}"
            continue
        if key == "cp" and row["tp"].startswith(("not built", "FAIL")):
            row["cp"] = "-"  # what tp=2 could not build or run, cp=2 does not either
            continue
        start = time.monotonic()
        try:
            result = pool_of(2).run(_run, check, model_type, plan, timeout=TIMEOUT_S)
            row[key] = "pass"
            row[key + "_detail"] = result[-1]
        except AssertionError as error:
            text = str(error)
            line = _first_line(text.split("\n", 1)[-1] if "\n" in text.strip() else text)
            refused = key == "cp" and line.startswith(REFUSALS)
            not_checked = line.startswith("NotImplementedError: check_cp")
            row[key] = ("refused: " + line.split(": ", 1)[1] if refused else
                        "not checked: " + line.split(": ", 1)[1] if not_checked else "FAIL: " + line)
        row[key + "_s"] = time.monotonic() - start


def _table(rows, split_column: bool = False) -> list:
    """The rows as a table; ``split_column``: how many linears of each layer kind tp=2 split (plan="auto")."""
    lines = ["| model type | tp=2 | pp=2 (zb-h1) | cp=2 |" +
             (" linears split per layer (tp=2) |" if split_column else ""),
             "|---|---|---|---|" + ("---|" if split_column else "")]
    for row in sorted(rows, key=lambda r: r["type"]):
        cells = [row["tp"], row["pp"], row.get("cp", "")] + ([_split_cell(row)] if split_column else [])
        lines.append(f"| {row['type']} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def _split_cell(row) -> str:
    """What a passing tp=2 check split, read from its detail (torchpp.testing.model_checks.check_tp)."""
    from torchpp.testing.model_checks import SPLIT_NOTE

    detail = row.get("tp_detail", "") if row["tp"] == "pass" else ""
    return detail.split(SPLIT_NOTE, 1)[1] if SPLIT_NOTE in detail else ""


def _passing(rows) -> int:
    return sum(r["tp"] == "pass" and r["pp"] == "pass" for r in rows)


def _excepted(row) -> bool:
    return any(row[key].startswith(("not built", "not pipelined")) for key in ("tp", "pp"))


def _minutes(rows) -> float:
    return sum(row.get("tp_s", 0) + row.get("pp_s", 0) + row.get("cp_s", 0) for row in rows) / 60


def _cp_summary(rows) -> str:
    """How the cp=2 column came out: passing, refused with the reason, the rest."""
    cells = [row.get("cp", "") for row in rows]
    passing, refused = sum(c == "pass" for c in cells), sum(c.startswith("refused") for c in cells)
    failing = sum(c.startswith("FAIL") for c in cells)
    return (f"At cp=2 (`torchpp.testing.model_checks.check_cp`: the sequence split over 2 ranks, zigzag, ring; the "
            f"same comparisons, logits gathered; a base model's hidden states gathered, a fixed probe of them its "
            f"loss): **{passing} pass**, {refused} are refused with the reason (what a "
            f"shard of the sequence cannot run: `torchpp.context_parallel.hf_support`), {failing or 'none'} "
            f"fail{'s' if failing == 1 else ''}; the rest are not built, or not checked (a causal LM whose forward "
            f"returns no loss).")


def _exception_lines(rows) -> list:
    """One line per excepted type: which check it skips and why."""
    lines = []
    for row in sorted(rows, key=lambda r: r["type"]):
        skipped = [key for key in ("tp", "pp") if row[key].startswith(("not built", "not pipelined"))]
        reason = row[skipped[0]]
        lines.append(f"- `{row['type']}` ({' and '.join(k + '=2' for k in skipped)} {reason.split(':')[0]}): "
                     f"{reason.split(': ', 1)[1]}" + ("; it passes tp=2" if skipped == ["pp"] and row["tp"] == "pass"
                                                      else ""))
    return lines


def _not_run_lines(done, every) -> list:
    """The types of a table the kept rows lack (a sweep cut short), named."""
    missing = sorted(set(every) - set(done))
    return ["", f"Not run yet ({len(missing)} of {len(every)} types): " + ", ".join(missing) + "."] if missing else []


def write_table(rows, path: str) -> None:
    """docs/models.md from the rows, with each table's summed check times."""
    import torch
    import transformers

    plans = [r for r in rows if r.get("table", "plans") == "plans"]
    auto = [r for r in rows if r.get("table") == "auto"]
    exceptions = [r for r in plans if _excepted(r)]
    failing = [r for r in plans if not _excepted(r) and not (r["tp"] == "pass" and r["pp"] == "pass")]
    lines = [
        "# Models: the plan-driven wrapping of every transformers type with plans",
        "",
        "`bench/model_sweep.py` builds a tiny random model of each transformers model type whose config carries both",
        "`base_model_tp_plan` and `base_model_pp_plan` (`torchpp.testing.tiny_models`: 4 layers of each kind the type",
        "has, 4 heads, vocabulary 97, float64), wraps it with `torchpp.models.parallelize` at tp=2 (the model called",
        "as before: loss, full logits), at pp=2 (zb-h1, 4 microbatches, `model.step`) and at cp=2 (the sequence split",
        "over 2 ranks), and compares loss, logits, every gradient and one SGD step with the unwrapped model (rtol 1e-9).",
        "A failure shows its error; a cp=2 refusal its reason.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}: **{_passing(plans)} of {len(plans)} types "
        f"pass both**; {len(failing) or 'none'} fail{'s' if len(failing) < 2 else ''}; {len(exceptions)} are exceptions, each because its forward takes no token",
        "ids or transformers itself cannot run (or pipeline) it:",
        "",
        *_exception_lines(exceptions),
        "",
        _cp_summary(plans),
        "",
        f"Sweep time {_minutes(plans):.1f} min for this table (summed check times, 2 spawned gloo ranks) on this shared",
        "2-core machine.",
        "",
        "    python bench/model_sweep.py",
        "",
        "What lets the newer families wrap, each a mechanism rather than a family's code",
        "(`tests/distributed/test_model_mechanisms.py` checks each on a small family, and Gemma 4 (text and unified),",
        "DeepSeek-V4 and Mistral Large 4 at tp=2 and at pp=2 under zb-h1 and interleaved-1f1b):",
        "",
        "- per-layer configs (transformers' heterogeneous configs: Gemma 4, DiffusionGemma, dots3): head counts and",
        "  head_dim are read per layer when sharding;",
        "- a traced forward (`torchpp.models.run_order`) tells which modules run before and after the layers, whatever",
        "  order they were registered in (T5Gemma's final norm, Phi-4's and Gemma 3n's embeddings), and which feed every",
        "  layer (per-layer embeddings, a learned rotary scale): those stay on every pipeline rank, their gradients",
        "  summed over the pipeline; so an encoder-decoder-shaped model's tied embedding and head (T5Gemma 2's text",
        "  model, its final norm registered before the layers) land on the first and last stages, gradients summed;",
        "- what travels between stages besides the hidden states: the token ids (DeepSeek-V4's hash routing, Higgs",
        "  audio's audio-token masks), extra layer outputs (Mistral Large 4's and GLM-MoE-DSA's top-k indices) and what",
        "  layers leave for later ones (Gemma 3n's shared key/value states);",
        "- statistics across a split width (ESMC's q/k norms, Gemma 3n's sparse activations) make that group gather, and a",
        "  row split no column split feeds stays whole (`torchpp.models.split_checks`);",
        "- plan fixes: fused `gate_up_proj` split half by half, shared experts' inputs entering through f (Inkling),",
        "  Doge's per-head dynamic mask;",
        "- float64 comparisons: modules transformers keeps in float32 are float64 too, and float32 softmax by any route",
        "  (function or tensor method) runs in float64 (`torchpp.testing.model_checks.float64_throughout`).",
        "",
        *_table(plans),
    ]
    if auto:
        lines += [
            "",
            '## Models without plans: `plan="auto"`',
            "",
            "Every causal-LM type in transformers whose config lacks a tensor- or pipeline-parallel plan, wrapped",
            'with `parallelize(model, plan="auto")` (`torchpp.models.auto_plan`: the stack is the longest ModuleList',
            "no layer of another holds; linears reading a layer branch's input that feed the linear writing its output are split",
            "by columns, the writer by rows, each group first tried on one layer in one process and kept whole where",
            "its split fails or changes the output; a low-rank projection a linear widens back up (MLA's q_a and kv_a,",
            "a LoRA adapter's A) stays whole and what widens it splits by columns; a group with a linear the rule",
            "cannot decide (one between two others)",
            "stays whole, the rest of the layer still splits), checked as above. Experts held as raw 3-D parameters",
            "(`gate_up_proj`/`up_proj` and `down_proj`) split as transformers' own MoE plans split them, each kind tried",
            "first (`torchpp.models.auto_experts`); experts' linears in one 3-D weight applied expert by expert (JetMoE's)",
            "are linears to the rule (`torchpp.tensor_parallel.expert_linears`). The last column says how many of each",
            "layer kind's linears (an experts module counting as one) tp=2 split; a model where nothing splits fails with",
            "the PlanError naming why. A family",
            "torchpp has its own plan for (GPT-2, Mamba, Falcon-Mamba, Mamba 2: `torchpp.models.plans`) takes it.",
            "",
            f"**{_passing(auto)} of {len(auto)} types pass both**; sweep time {_minutes(auto):.1f} min (summed check "
            "times). Each failure shows its error as it is: where nothing can be split (PlanError naming why), a "
            "tiny model transformers itself cannot build or run, or a wrapping bug not yet fixed. " + _cp_summary(auto),
            *_not_run_lines([r["type"] for r in auto], auto_types()),
            "",
            "    python bench/model_sweep.py --auto",
            "",
            *_table(auto, split_column=True),
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def auto_types():
    """Causal-LM types whose config lacks a tensor- or a pipeline-parallel plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[model_type]
            if not (getattr(cls, "base_model_tp_plan", None) and getattr(cls, "base_model_pp_plan", None)):
                types.append(model_type)
        except Exception:  # a config class that fails to import its dependencies
            continue
    return sorted(types)


def main() -> None:
    import glob
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", help="model types (default: every type of both tables)")
    parser.add_argument("--auto", action="store_true", help='the plan="auto" table (default: the plans table)')
    parser.add_argument("--slice", nargs=2, type=int, metavar=("K", "N"), help="the K-th of N slices of both tables")
    parser.add_argument("--rows", help="append each type's row (JSON) to this file")
    parser.add_argument("--from-rows", nargs="*", help="write docs/models.md from rows files, run nothing")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "models.md"))
    args = parser.parse_args()
    from torchpp.testing.tiny_models import causal_lm_types

    if args.from_rows:
        rows = {}
        for path in sorted({p for pattern in args.from_rows for p in glob.glob(pattern)}):
            for line in open(path):
                row = json.loads(line)
                rows[(row["table"], row["type"])] = row  # a later run of a type replaces an earlier one
        write_table(list(rows.values()), args.out)
        print(f"wrote {args.out} from {len(rows)} rows")
        return
    from harness import RankPools

    every = [(t, None) for t in causal_lm_types()] + [(t, "auto") for t in auto_types()]
    if args.slice:
        k, n = args.slice
        jobs = every[k::n]
    elif args.types or args.auto:
        plan = "auto" if args.auto else None
        jobs = [(t, plan) for t in (args.types or auto_types())]
    else:
        jobs = every
    pools = RankPools()
    start = time.monotonic()
    rows = []
    try:
        for plan in (None, "auto"):
            rows += sweep([t for t, p in jobs if p == plan], pools, plan, args.rows)
    finally:
        pools.close()
    seconds = time.monotonic() - start
    print(f"{_passing(rows)} of {len(rows)} types pass at tp=2 and pp=2 ({seconds / 60:.1f} min)")
    if not args.types and not args.slice and not args.auto:
        write_table(rows, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
