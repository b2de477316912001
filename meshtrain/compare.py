"""Compare training runs: eval loss against wall time and tokens, throughput over time.

    meshtrain compare W1 W2 ... --out=FILE.png [--labels=a,b] [--smooth=N]

Each W is a workdir written by `python -m meshtrain.train --workdir=W`; the command reads
its run.json, metrics.jsonl and goodput.jsonl and draws one figure (.png, .pdf or .svg) of
four panels:

  1. eval loss against wall time (seconds since the run's step was compiled),
  2. eval loss against tokens seen (step x run.json's tokens_per_step),
  3. throughput (tokens/s of the train rows) against wall time,
  4. where each run's wall time went (meshtrain/runlog/goodput.py's shares, all pieces added up).

A layout that is faster per step may need more steps: panel 1 says which wins (the
statistical-efficiency view of Nichols et al., arXiv 2111.04949). Runs are labelled
"config_name (layout, mesh axes above 1)" unless --labels gives one name per workdir.
--smooth=N draws each curve as the trailing mean of N points (default 1: as logged); the
table uses the values as logged.

Wall time is each row's `time_s` (see docs/compare.md). Runs logged before `time_s`
existed fall back to the cumulative sum of step_time_s x the steps since the previous
train row, which leaves out compile, eval and checkpoint time; a note says so.

Stdout gets a table (per run: final eval loss, tokens, wall time, mean of the train rows'
tokens/s, goodput) and which run first reached the lowest eval loss that every run reached. Bad
input exits with status 2 and one paragraph, no traceback.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from meshtrain import cli
from meshtrain.errors import UserError
from meshtrain.runlog import goodput

FORMATS = (".png", ".pdf", ".svg")


@dataclasses.dataclass
class Run:
    """One workdir's curves. Series are lists of (step, wall seconds, value) in step order:
    `train` holds tokens/s, `evals` eval loss. `fallback`: times from step_time_s."""

    workdir: Path
    label: str
    tokens_per_step: int
    best_loss: float | None
    train: list[tuple[int, float, float]]
    evals: list[tuple[int, float, float]]
    fallback: bool
    shares: dict | None = None  # goodput.add_up of the workdir's pieces; None before goodput.jsonl

    @property
    def last_step(self) -> int:
        return max((s for s, _, _ in self.train + self.evals), default=0)

    @property
    def wall_s(self) -> float:
        return max((t for _, t, _ in self.train + self.evals), default=0.0)


def parser() -> cli.Parser:
    p = cli.command_parser("meshtrain compare", __doc__)
    p.add_argument("workdirs", nargs="*", type=Path, metavar="WORKDIR",
                   help="workdirs of `meshtrain train --workdir=DIR` runs")
    p.add_argument("--out", type=Path, metavar="FILE", help=f"the figure: {', '.join(FORMATS)} (required)")
    p.add_argument("--labels", metavar="A,B", help="one label per workdir, in order "
                                                   "(default: config, layout and mesh)")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="draw each curve as the trailing mean of N points")
    return p


def check_args(args) -> tuple[list[Path], Path, list[str] | None, int]:
    """-> (workdirs, output path, labels or None, smoothing window >= 1), checked."""
    workdirs, out = args.workdirs, args.out
    if not workdirs:
        raise UserError("No workdir given: name at least one directory that `meshtrain train "
                        "--workdir=DIR` wrote, e.g. `meshtrain compare runs/a runs/b --out=runs.png`.")
    if out is None or out.suffix.lower() not in FORMATS:
        given = f"--out={str(out)!r}" if out is not None else "no --out"
        raise UserError(f"{given}: the figure's file must end in {', '.join(FORMATS)} (the format "
                        f"follows the suffix), e.g. --out=compare.png.")
    if not out.parent.is_dir():
        raise UserError(f"--out={str(out)!r}: the directory {str(out.parent)!r} does not exist; create it first.")
    labels = None if args.labels is None else args.labels.split(",")
    if labels is not None and len(labels) != len(workdirs):
        raise UserError(f"--labels={args.labels!r} names {len(labels)} run(s), but {len(workdirs)} "
                        f"workdir(s) were given: give one comma-separated label per workdir, in order.")
    if args.smooth < 1:
        raise UserError(f"--smooth={args.smooth!r}: give a whole number of points >= 1 (1 draws the "
                        f"curves as logged).")
    return workdirs, out, labels, args.smooth


def read_rows(workdir: Path, notes: list[str]) -> list[dict]:
    """metrics.jsonl as dicts; a line that is not JSON (a crash mid-write) is skipped with a note."""
    if not workdir.exists():
        raise UserError(f"Workdir {str(workdir)!r} does not exist. Give directories that "
                        f"`python -m meshtrain.train --workdir=DIR` wrote.")
    if not workdir.is_dir():
        raise UserError(f"{str(workdir)!r} is a file, not a workdir. Give the directory that holds "
                        f"run.json and metrics.jsonl.")
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        why = ("a compile-only run (train.steps=0) logs no rows" if (workdir / "run.json").is_file()
               else "it has no run.json either, so it is not a training workdir")
        raise UserError(f"{str(workdir)!r} has no metrics.jsonl: {why}. Give workdirs of runs that "
                        f"trained at least train.log_every steps.")
    rows, bad = [], 0
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
        else:
            bad += 1
    if bad:
        notes.append(f"{path}: skipped {bad} line(s) that are not JSON rows with a step (a run "
                     f"stopped mid-write?).")
    return rows


def wall_times(rows: list[dict]) -> tuple[list[float], bool]:
    """Seconds for each row: its `time_s`, or when any row lacks one, the cumulative
    step_time_s x steps since the previous train row (eval rows take the time of their
    step at the next train row's rate). -> (times, whether the fallback was used)."""
    if all("time_s" in r for r in rows):
        return [float(r["time_s"]) for r in rows], False
    train = sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])
    clock, prev, marks = 0.0, 0, []  # marks: (step, seconds at that step, s/step up to it)
    for r in train:
        clock += r["step_time_s"] * (r["step"] - prev)
        marks.append((r["step"], clock, r["step_time_s"]))
        prev = r["step"]

    def at(step: int) -> float:
        before = ([(0, 0.0)] + [(s, t) for s, t, _ in marks if s <= step])[-1]
        rate = next((d for s, _, d in marks if s >= step), marks[-1][2] if marks else 0.0)
        return before[1] + rate * (step - before[0])
    return [at(r["step"]) for r in rows], True


def default_label(info: dict, workdir: Path) -> str:
    """"config_name (layout, data:2,tensor:4)" from run.json."""
    shape = info.get("mesh", {}).get("shape", {})
    axes = ",".join(f"{a}:{n}" for a, n in shape.items() if n != 1) or "1"
    layout = info.get("layout", {}).get("name", "?")
    return f"{info.get('config_name', workdir.name)} ({layout}, {axes})"


def load_run(workdir: Path, label: str | None, notes: list[str]) -> Run:
    """One workdir -> Run, adding notes on fallbacks and missing eval rows."""
    rows = read_rows(workdir, notes)
    try:
        info = json.loads((workdir / "run.json").read_text())
        tokens_per_step = int(info["tokens_per_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{str(workdir)!r}: cannot read tokens_per_step from run.json ({type(e).__name__}: "
                        f"{e}); it gives the tokens axis and the label. Give workdirs written by "
                        f"`python -m meshtrain.train --workdir=DIR`.") from None
    times, fallback = wall_times(rows)
    label = label or default_label(info, workdir)
    run = Run(workdir, label, tokens_per_step, (info.get("data") or {}).get("best_loss"),
              [(r["step"], t, float(r["tokens_per_s"])) for r, t in zip(rows, times) if "loss" in r],
              [(r["step"], t, float(r["eval_loss"])) for r, t in zip(rows, times) if "eval_loss" in r],
              fallback, goodput.add_up(pieces) if (pieces := goodput.read_pieces(workdir)) else None)
    if run.shares is None:
        notes.append(f"{workdir}: no goodput.jsonl (a run from before it existed): no time-shares bar.")
    if fallback and rows:
        notes.append(f"{workdir}: metrics.jsonl has no time_s (logged before it existed); wall time is the "
                     f"cumulative step_time_s x steps, without compile, eval and checkpoint time.")
    if not rows:
        notes.append(f"{workdir}: metrics.jsonl has no rows; nothing to draw for this run.")
    elif not run.evals:
        notes.append(f"{workdir}: no eval rows (train.eval_every=0?), so the eval loss panels have no "
                     f"points for this run.")
    return run


def smoothed(values: list[float], n: int) -> list[float]:
    """Trailing mean over up to `n` points, same length as `values`."""
    return [sum(values[max(0, i - n + 1):i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(values))]


def table(runs: list[Run]) -> list[str]:
    """The stdout summary: one line per run, then which run first reached the target: the
    lowest eval loss that every run with eval rows reached (so each run has a time for it)."""
    scored = [r for r in runs if r.evals]
    target = max((min(v for *_, v in r.evals) for r in scored), default=None)
    reached = {id(r): next(t for _, t, v in r.evals if v <= target) for r in scored}
    width = max(len(r.label) for r in runs)
    lines = [f"{'run':<{width}}  {'final eval loss':>15}  {'tokens':>12}  {'wall time':>10}  "
             f"{'mean tok/s':>11}  {'to target':>10}  {'goodput':>7}"]
    for r in runs:
        final = f"{r.evals[-1][2]:.4f}" if r.evals else "-"
        mean = f"{sum(v for *_, v in r.train) / len(r.train):,.0f}" if r.train else "-"
        to_target = f"{reached[id(r)]:.1f}s" if id(r) in reached else "-"
        good = f"{100 * r.shares['goodput']:.0f}%" if r.shares and r.shares["goodput"] is not None else "-"
        lines.append(f"{r.label:<{width}}  {final:>15}  {r.last_step * r.tokens_per_step:>12,}  "
                     f"{r.wall_s:>9.1f}s  {mean:>11}  {to_target:>10}  {good:>7}")
    if target is None:
        return lines + ["no run has eval rows: no eval loss to compare."]
    first = min(scored, key=lambda r: reached[id(r)])
    return lines + [f"target: eval loss <= {target:.4f}, the lowest that every run with evals reached; "
                    f"first there in wall time: {first.label} ({reached[id(first)]:.1f}s)"]


def plot(runs: list[Run], out: Path, smooth: int) -> None:
    """Writes the four-panel figure to `out` (format from the suffix), with Agg."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a_time, a_tokens, a_speed, a_shares) = plt.subplots(1, 4, figsize=(21, 4.8), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        color = colors[i % len(colors)]  # one color per run in every panel
        if r.evals:
            loss = smoothed([v for *_, v in r.evals], smooth)
            a_time.plot([t for _, t, _ in r.evals], loss, marker=".", color=color, label=r.label)
            a_tokens.plot([s * r.tokens_per_step for s, _, _ in r.evals], loss, marker=".", color=color)
        if r.train:
            a_speed.plot([t for _, t, _ in r.train], smoothed([v for *_, v in r.train], smooth),
                         color=color, label=None if r.evals else r.label)
    best = {r.best_loss for r in runs if r.best_loss is not None}
    if len(best) == 1 and any(r.evals for r in runs):  # one synthetic source: its entropy rate
        for ax in (a_time, a_tokens):
            ax.axhline(min(best), color="gray", ls=":", lw=1,
                       label="best possible loss (data)" if ax is a_time else None)
    a_time.set(title="eval loss vs wall time", xlabel="wall time (s)", ylabel="eval loss")
    a_tokens.set(title="eval loss vs tokens seen", xlabel="tokens (step x tokens_per_step)", ylabel="eval loss")
    a_speed.set(title="throughput", xlabel="wall time (s)", ylabel="tokens/s")
    a_tokens.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    draw_shares(a_shares, runs)
    handles = [h for ax in (a_time, a_tokens, a_speed) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(runs) + 1, 4), frameon=False)
    smooth_note = f", trailing mean of {smooth} points" if smooth > 1 else ""
    fig.suptitle(f"{len(runs)} run(s): loss against time and tokens{smooth_note}")
    for ax in (a_time, a_tokens, a_speed, a_shares):
        ax.grid(alpha=0.3)
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise UserError(f"--out={str(out)!r}: cannot write the figure ({e}).") from None
    finally:
        plt.close(fig)


def draw_shares(ax, runs: list[Run]) -> None:
    """One horizontal bar per run: its wall time, split into goodput's shares."""
    import matplotlib.pyplot as plt
    cmap = plt.get_cmap("tab10")
    drawn = [r for r in runs if r.shares]
    for y, r in enumerate(drawn):
        left = 0.0
        for k, share in enumerate(goodput.SHARES):
            width = r.shares["seconds"][share]
            ax.barh(y, width, left=left, color=cmap(k), label=share if y == 0 else None)
            left += width
    ax.set_yticks(range(len(drawn)), [f"{r.label}\n{100 * (r.shares['goodput'] or 0):.0f}% goodput" for r in drawn],
                  fontsize=7)
    ax.set(title="where the wall time went (all pieces)", xlabel="seconds")
    if drawn:
        ax.legend(fontsize=7, loc="lower right")


def execute(args) -> int:
    workdirs, out, labels, smooth = check_args(args)
    notes: list[str] = []
    runs = [load_run(w, labels[i] if labels else None, notes) for i, w in enumerate(workdirs)]
    if not any(r.train or r.evals for r in runs):
        raise UserError(f"None of the {len(runs)} workdir(s) has any train or eval rows in its "
                        f"metrics.jsonl: nothing to plot. Compare runs that logged at least one step.")
    seen: dict[str, int] = {}
    for r in runs:  # two runs of one config and layout: tell them apart by directory
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1 and labels is None:
            r.label = f"{r.label} [{r.workdir}]"
    plot(runs, out, smooth)
    print("\n".join(table(runs)))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {out}")
    return 0


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
