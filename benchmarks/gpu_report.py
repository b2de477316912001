"""benchmarks/gpu.py's results as Markdown: the runs table and the goals, and the section of
docs/benchmarks.md between the gpu-table markers that `--docs` rewrites."""

from __future__ import annotations

import pathlib

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gpu-table -->", "<!-- /gpu-table -->"
# (key, what, goal, stretch): MFU in llm.c's convention at the best remat policy; the
# overhead row is a ratio of step times, lower is better.
GOALS = (
    ("gpt2_small", "GPT-2 small (124M), T=1024: MFU, llm.c convention", 0.45, 0.50),
    ("gpt2_medium", "GPT-2 medium (355M), T=1024: MFU, llm.c convention", 0.50, 0.55),
    ("llama3_1b", "Llama 3.2 1B, T=2048: MFU, llm.c convention", 0.45, 0.50),
    ("overhead", "meshtrain step / bare-JAX step, GPT-2 small (benchmarks/overhead.py)", 1.02, 1.00),
)
GIB = 2**30


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def goals_table(results: dict | None) -> list[str]:
    """One row per goal; "not measured" where `results` (or its run) has nothing."""
    lines = ["| goal | target | stretch | measured |", "|---|---|---|---|"]
    for key, what, goal, stretch in GOALS:
        if key == "overhead":
            target, high = f"<= {goal:.2f}", f"{stretch:.2f}"
            o = (results or {}).get("overhead") or {}
            on = "" if o.get("model") == "gpt2_small" else f" on {o.get('model')}"
            got = (f"{o['ratio']:.3f} (IQR {o['iqr'][0]:.3f}-{o['iqr'][1]:.3f}){on}, "
                   f"{'met' if o['ratio'] <= goal else 'not met'}") if o.get("ratio") else "not measured"
        else:
            target, high = f">= {goal:.0%}", f"{stretch:.0%}"
            best = (results or {}).get("best_remat", {}).get(key)
            mfu = best and best.get("mfu_llmc")
            got = (f"{pct(mfu)} (remat {best['remat']}), {'met' if mfu >= goal else 'not met'}"
                   if mfu is not None else "not measured")
        lines.append(f"| {what} | {target} | {high} | {got} |")
    return lines


def runs_table(results: dict) -> list[str]:
    """One row per (model, remat) run; the best remat of each model in bold."""
    best = {m: b["remat"] for m, b in results.get("best_remat", {}).items()}
    lines = ["| model | remat | batch x T | tokens/s | MFU llm.c | MFU PaLM | step ms (spread) | "
             "peak GiB (compiled estimate) | compile s | attention |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("runs", []):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['remat']} | {r['error']} | | | | | | | |")
            continue
        mem = r["memory"]
        peak = "n/a" if mem["peak_bytes_in_use"] is None else f"{mem['peak_bytes_in_use'] / GIB:.2f}"
        est = mem["compiled"].get("peak_estimate")
        remat = f"**{r['remat']}**" if best.get(r["model"]) == r["remat"] else r["remat"]
        lines.append(
            f"| {r['model']} | {remat} | {r['batch']} x {r['seq_len']} | {r['tokens_per_s']:,.0f} | "
            f"{pct(r['mfu']['llmc'])} | {pct(r['mfu']['palm'])} | {1e3 * r['step_s_median']:.1f} "
            f"({100 * r['spread']:.1f}%) | {peak} ({'n/a' if est is None else f'{est / GIB:.2f}'}) | "
            f"{r['compile_s']:.1f} | {r['attention']} |")
    return lines


def describe(results: dict) -> list[str]:
    d = results["device"]
    v = d.get("versions", {})
    cuda = ", ".join(f"{k} {v[k]}" for k in ("cuda_runtime", "cudnn", "nvidia_driver") if k in v)
    note, st = results["xla_flags"]["note"] or "", results["settings"]
    # A session of several commands says its timing per command (settings["timing"]).
    timing = st.get("timing") or f"{st['warmup']} warm-up steps, then {st['repeats']} x {st['steps']} timed steps"
    lines = [f"Measured on 1 x {d['device_kind']} ({d['platform']}) on {results['date']} by "
             f"`{results['command']}`.",
             "",
             f"- Versions: jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, flax {v.get('flax')}, "
             f"optax {v.get('optax')}{'; ' + cuda if cuda else ''}.",
             f"- XLA flags: {note.removeprefix('XLA flags: ') or 'none (not on a GPU)'} "
             f"XLA_FLAGS was `{results['xla_flags']['XLA_FLAGS'] or ''}`.",
             f"- Each run: bf16 compute, float32 params and Adam, synthetic data (4 batches on the "
             f"device, reused), {timing}; tokens/s from "
             f"the median repeat, spread = (max - min) / median over the repeats. Batch: the largest "
             f"from {results['settings']['max_batch']} down (halving) whose compiled estimate fits "
             f"the allocator's limit and that ran without RESOURCE_EXHAUSTED."]
    for model, b in results.get("best_remat", {}).items():
        lines.append(f"- {model}: best remat **{b['remat']}** ({b['why']}).")
    o = results.get("overhead")
    if o:
        lines.append(f"- Bare-JAX comparison ({o['command']}): " + (
            f"median ratio meshtrain/bare {o['ratio']:.3f} (IQR {o['iqr'][0]:.3f}-{o['iqr'][1]:.3f}), "
            f"meshtrain {o['meshtrain_ms']:.2f} ms, bare {o['bare_ms']:.2f} ms; {o['equal']}."
            if o.get("ratio") else f"no result: {o.get('error')}"))
    return lines


def section(results: dict | None) -> str:
    """The Markdown between the markers: the runs and goals, or the goals not measured yet."""
    if results is None:
        body = ["Not measured yet: no GPU run has been recorded. The goals:", "", *goals_table(None)]
    else:
        body = [*describe(results), "", *runs_table(results), "", "Goals:", "", *goals_table(results)]
    return "\n".join(body)


def rewrite_docs(results: dict | None, path: pathlib.Path = DOCS) -> None:
    text = path.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"benchmarks/gpu.py --docs: {path.name} needs one {BEGIN} and one {END} "
                         f"line around the GPU table; put them back to rewrite it.")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    path.write_text(f"{head}{BEGIN}\n{section(results)}\n{END}{tail}")
