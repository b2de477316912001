"""Where a run's metric rows go: metrics.jsonl, TensorBoard events, Weights & Biases.

`train.trackers` names them, a comma list (`tensorboard,jsonl` by default). RunLog
(meshtrain/runlog/metrics.py) makes them on process 0 and drives each one through

    start(info)       run.json's dict, once, after compiling (a tracker keeps what it needs)
    open() -> float   at the first row; the run's clock goes on from the largest value
    log(row)          every train and eval row, {"step": int, ..., "time_s": float}
    finish(summary)   the end-of-run summary (run.json's "summary"), possibly in pieces
    close()

A tracker that cannot start (not installed, a bad setup, an init error) or fails later
is one line on stderr and the run goes on without it: the metrics are never worth the
run. Resuming a workdir continues what is there: metrics.jsonl drops the rows after the
resumed step, TensorBoard purges them, W&B keeps the run id in WORKDIR/wandb_id.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import sys

from meshtrain.errors import comma_list, warn

NAMES = ("tensorboard", "jsonl", "wandb")


def parse(text: str) -> list[str]:
    """"tensorboard, wandb" -> ["tensorboard", "wandb"]; "" or "none" -> [] (checked:
    check_config)."""
    return list(comma_list("train.trackers", text, NAMES, "tensorboard,jsonl,wandb"))


def check_config(t) -> None:
    """train.trackers: a comma list of NAMES, each at most once (or "" / "none": no files
    but run.json)."""
    parse(t.trackers)


class Tracker:
    """The do-nothing tracker; subclasses override what they use."""
    name = "tracker"

    def start(self, info: dict) -> None:
        pass

    def open(self) -> float:
        return 0.0

    def log(self, row: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Jsonl(Tracker):
    """WORKDIR/metrics.jsonl, one row a line. A resumed run keeps the rows up to its
    checkpoint's step (a fresh start in a used workdir finds the old file already moved
    aside by RunLog, which says so)."""
    name = "jsonl"

    def __init__(self, workdir: pathlib.Path, resume_step: int | None):
        self.path = workdir / "metrics.jsonl"
        self.resume_step = resume_step
        self.file = None

    def open(self) -> float:
        offset = 0.0
        if self.resume_step is not None and self.path.exists():
            keep_rows_up_to(self.path, self.resume_step)
            offset = last_time_s(self.path)
        self.file = open(self.path, "a", buffering=1)
        return offset

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX imports torch
    wherever it is installed (only to accept its tensors, which meshtrain never logs): 1.7 s
    of every start on a 2-core machine that has it. While tensorboardX loads, `import torch`
    fails as if it were absent; afterwards it imports as usual, and a process that already
    holds torch keeps it."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoard(Tracker):
    """WORKDIR/tb/: every non-null field of a row but step and time_s is a scalar at its
    step (TensorBoard keeps its own wall time); a resumed run purges the steps after
    its checkpoint."""
    name = "tensorboard"

    def __init__(self, workdir: pathlib.Path, resume_step: int | None):
        purge = None if resume_step is None else resume_step + 1
        self.writer = _summary_writer()(str(workdir / "tb"), purge_step=purge)

    def log(self, row: dict) -> None:
        for k, v in row.items():
            if k not in ("step", "time_s") and v is not None:
                self.writer.add_scalar(k, v, row["step"])

    def close(self) -> None:
        self.writer.close()


class Wandb(Tracker):
    """A Weights & Biases run, its files under WORKDIR/wandb/ (the `wandb` extra). Its id
    is kept in WORKDIR/wandb_id, so a resumed workdir appends to the same run (a fresh
    start makes a new one, as metrics.jsonl does). The mode, project and entity come from
    wandb's own environment (WANDB_MODE=offline: no network; `wandb sync` uploads later);
    the project defaults to "meshtrain". The run starts at the first row, so a
    compile-only run leaves none."""
    name = "wandb"

    def __init__(self, workdir: pathlib.Path, resume_step: int | None):
        import wandb  # the optional extra; ImportError is reported by make()
        self.wandb = wandb
        self.workdir = workdir
        self.resume_step = resume_step
        self.config: dict = {}
        self.config_name = None
        self.run = None

    def start(self, info: dict) -> None:
        facts = ("config_name", "num_params", "device_kind", "device_count", "process_count",
                 "tokens_per_step", "mesh")
        self.config = {**info.get("config", {}), "run": {k: info[k] for k in facts if k in info}}
        self.config_name = info.get("config_name")

    def open(self) -> float:
        id_file = self.workdir / "wandb_id"
        run_id = id_file.read_text().strip() if self.resume_step is not None and id_file.exists() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # W&B's own ids are 8 lowercase characters too
            id_file.write_text(run_id + "\n")
        # wandb's own banner is replaced by our one line (WANDB_SILENT=false brings it back).
        settings = self.wandb.Settings(silent=os.environ.get("WANDB_SILENT", "true").lower() != "false")
        self.run = self.wandb.init(
            id=run_id, resume="allow", dir=str(self.workdir), config=self.config,
            project=None if "WANDB_PROJECT" in os.environ else "meshtrain",
            name=self.workdir.resolve().name, tags=[self.config_name] if self.config_name else None,
            settings=settings)
        mode = self.run.settings.mode
        if mode in ("offline", "dryrun"):
            where = pathlib.Path(self.run.dir).parent  # run.dir is the run's files/ folder
            how = f"offline in {where}; upload it later with: wandb sync {where}"
        else:
            how = self.run.url if mode != "disabled" else "disabled (WANDB_MODE=disabled): nothing is recorded"
        print(f"trackers: wandb run {run_id}, {'continued' if self.resume_step is not None else 'new'}, "
              f"{how}", flush=True)
        return 0.0

    def log(self, row: dict) -> None:
        # A resumed online run already holds its earlier steps; W&B drops (and warns about)
        # rows below them, so this run's repeats of those steps are left out here.
        if row["step"] < self.run.step:
            return
        # time_s is left to W&B's own clock (_runtime), as in TensorBoard: a train row and
        # an eval row of one step are one W&B row, and would give it two times.
        self.run.log({k: v for k, v in row.items() if k not in ("step", "time_s") and v is not None},
                     step=row["step"])

    def finish(self, summary: dict) -> None:
        if self.run is not None:
            self.run.summary.update(summary)

    def close(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish()
        finally:
            # Stops wandb's service process now. After a failure (the service killed, e.g.
            # by a scheduler that signals every process of the job) this also takes back
            # wandb's exit hook, which would report the same failure again as a traceback.
            try:
                self.wandb.teardown()
            except (Exception, SystemExit):  # already reported once by Trackers
                pass


KINDS = {"jsonl": Jsonl, "tensorboard": TensorBoard, "wandb": Wandb}
HINTS = {"wandb": 'install the extra: pip install -e ".[wandb]" in a checkout, or '
                  'pip install "meshtrain-jax[wandb] @ git+https://github.com/OWNER/REPO"',
         "tensorboard": "pip install tensorboardX"}
# What to try when a tracker fails to start.
FIXES = {"wandb": "Log in (wandb login), or set WANDB_MODE=offline to track without an account "
                  "or network and upload later with wandb sync (docs/architecture.md, \"Outputs\")."}


def one_line(e: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, cut at `limit` characters (wandb's errors span several)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def make(names: list[str], workdir: pathlib.Path, resume_step: int | None) -> list[Tracker]:
    """The trackers `names` (parsed train.trackers) writing under `workdir`; one that
    cannot be made is one warning and left out."""
    out = []
    for name in names:
        try:
            out.append(KINDS[name](workdir, resume_step))
        except ImportError as e:
            warn(f"tracker {name} is not installed ({one_line(e)}); this run goes on without it. To "
                 f"use it, {HINTS.get(name, 'install it')}.")
        except Exception as e:  # noqa: BLE001 - a tracker is never worth the run
            warn(f"tracker {name} could not start ({one_line(e)}); this run goes on without it.")
    return out


class Trackers:
    """Several trackers as one; a call that raises drops that tracker with one warning."""

    def __init__(self, trackers: list[Tracker]):
        self.live = list(trackers)

    def _each(self, what: str, *args) -> list:
        results = []
        for t in list(self.live):
            try:
                results.append(getattr(t, what)(*args))
            except Exception as e:  # noqa: BLE001 - a tracker is never worth the run
                self.live.remove(t)
                doing = "could not start" if what == "open" else f"failed ({what})"
                warn(f"tracker {t.name} {doing} ({one_line(e)}); this run goes on without it."
                     + (f" {FIXES[t.name]}" if what == "open" and t.name in FIXES else ""))
                if what != "close":
                    self._close_quietly(t)
        return results

    @staticmethod
    def _close_quietly(t: Tracker) -> None:
        try:
            t.close()
        except Exception:  # noqa: BLE001 - already reported once
            pass

    def start(self, info: dict) -> None:
        self._each("start", info)

    def open(self) -> float:
        return max(self._each("open"), default=0.0)

    def log(self, row: dict) -> None:
        self._each("log", row)

    def finish(self, summary: dict) -> None:
        self._each("finish", summary)

    def close(self) -> None:
        self._each("close")
        self.live = []


def keep_rows_up_to(path: pathlib.Path, step: int) -> None:
    """Rewrites a metrics.jsonl without the rows after `step` (atomically: a crash keeps the old file)."""
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)


def last_time_s(path: pathlib.Path) -> float:
    """The `time_s` of the last row of a metrics.jsonl that has one (0.0 for none, as in
    runs logged before `time_s` existed)."""
    for line in reversed(path.read_text().splitlines()):
        if line.strip() and "time_s" in (row := json.loads(line)):
            return float(row["time_s"])
    return 0.0
