"""Gate a merge on record reproduction: statistics over repeated runs, a decision, and its evidence.

A change that claims or keeps the track-1 record is judged on repeated runs, as the upstream rules ask: the
candidate's mean final val loss must be below the target (3.28) with a one-sided one-sample t-test p < alpha
(0.01), and, given a baseline re-run on the same hardware, the candidate must be faster, by a one-sided Welch
test at p < alpha. ``--systems-only`` (a change that does not touch the ML; upstream waives the loss test for
those) replaces the loss test by a check that the candidate's losses are not distinguishable from the
baseline's: two-sided Welch p >= alpha. That check has little power with few runs; it catches a visible
shift, it does not prove equality.

Each directory holds runs: upstream text logs (``*.txt``), or this project's run directories (a directory
holding ``events.jsonl`` and/or ``log.txt``, written by ``track_1_short/run_log.py``; ``events.jsonl`` is read
when present, as it keeps the full-precision loss). A resumed run continues in its own directory after a
marker (a ``resume`` event; a ``resumed at step:K/M`` line): it is one run, and what it logged after step K
before the marker is superseded. A run is finished when it has a val line or event at
step == total steps; that line gives the run's loss and its time (``train_time`` at that line); a final val
event that names its gated loss in ``gate_reads`` (with ``canonical_mask`` on: ``val_loss_masked``) is read by
that name, and its ``step:M/M val_loss:X`` line carries the same loss. Runs that did
not finish are listed and excluded. A finished run whose final loss is not finite (nan, inf) diverged: it
fails a candidate set and is left out of a baseline's statistics, with a note.

The target is the candidate runs' own: ``smoke_target`` from their ``config.yaml`` (the preset's), 3.28 for
runs on FineWeb and for upstream logs, which have no config; ``--target`` overrides it. The runs of one set
must repeat one configuration: configs that differ in more than the seed (and where a run lives) are refused,
each differing key named.

    python tools/record_gate.py CANDIDATE_DIR [--baseline DIR] [--target LOSS] [--alpha 0.01]
        [--systems-only] [--json PATH] [--markdown PATH] [--plot PATH]

Exit status: 0 pass, 1 fail, 2 bad input (nothing can be decided); the reasons are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
# Upstream record target (track 1, mean FineWeb val loss) and significance level (README "Rules").
DEFAULT_TARGET = 3.28
DEFAULT_ALPHA = 0.01
PROGRESS_FORMAT = "step:N/M val_loss:X.XXXX train_time:Yms step_avg:Z.ZZms"

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(r"\d+")
# A resumed run's marker in its log.txt (track_1_short/run_log.py writes it).
_RESUMED = re.compile(r"^resumed at step:(?P<step>\d+)/(?P<total>\d+)")
# How Python prints a non-finite float (run_log.py logs a poisoned loss the same way, as a string).
_NON_FINITE = {"nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


class RecordGateInputError(ValueError):
    """The logs cannot be scored (missing, malformed or too few runs); nothing can be decided."""


# ---------------------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run as read from its log: the final val figures and the val-loss curve."""

    name: str
    source: Path  # the file the figures came from
    total_steps: int | None  # M of step:N/M; None when the log has no step at all
    final_loss: float | None  # val loss at step == total_steps (may be nan: diverged); None if unfinished
    final_time_ms: float | None  # train_time at that val, ms
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, val loss) of every val, in order
    not_finished: str | None = None  # why the run does not count; None when it finished
    config: dict | None = None  # the run directory's config.yaml; None for upstream logs

    @property
    def finished(self) -> bool:
        return self.not_finished is None

    @property
    def diverged(self) -> bool:
        return self.finished and not math.isfinite(self.final_loss)


@dataclass
class _Val:
    step: int
    total_steps: int
    loss: float
    time_ms: float


def _decimal(text: str, name: str, where: str) -> float:
    if not _DECIMAL.fullmatch(text):
        raise RecordGateInputError(
            f"{where}: field {name} is not a number: {text!r} (progress lines read {PROGRESS_FORMAT!r}); "
            "fix or remove that log."
        )
    return float(text)


def _loss(text: str, where: str) -> float:
    """A logged val loss: a decimal, or nan/inf for a run that diverged."""
    if text.lower() in _NON_FINITE:
        return float(text)
    return _decimal(text, "val_loss", where)


def _integer(text: str, name: str, where: str) -> int:
    if not _INTEGER.fullmatch(text):
        raise RecordGateInputError(
            f"{where}: field {name} is not a whole number: {text!r} (progress lines read "
            f"{PROGRESS_FORMAT!r}); fix or remove that log."
        )
    return int(text)


def _milliseconds(text: str, name: str, where: str) -> float:
    if not text.endswith("ms"):
        raise RecordGateInputError(
            f"{where}: field {name} {text!r} lacks its 'ms' unit (progress lines read {PROGRESS_FORMAT!r}); "
            "fix or remove that log."
        )
    return _decimal(text[:-2], name, where)


def _parse_progress(line: str, where: str) -> tuple[int, int, float, float | None]:
    """``step:N/M [val_loss:X] train_time:Yms step_avg:Zms`` -> (N, M, train time ms, val loss or None).

    Fields other than these are ignored; train_time and step_avg are required, so no strict prefix of a
    line parses (that is how a line cut off by a crash is recognised).
    """
    head, *tokens = line.split()
    step_text, slash, total_text = head.removeprefix("step:").partition("/")
    if not slash:
        raise RecordGateInputError(
            f"{where}: {line!r} has no step:N/M field; progress lines read {PROGRESS_FORMAT!r}."
        )
    fields: dict[str, str] = {}
    for token in tokens:
        key, colon, value = token.partition(":")
        if not colon:
            raise RecordGateInputError(
                f"{where}: {token!r} in {line!r} is not a key:value field; progress lines read "
                f"{PROGRESS_FORMAT!r}."
            )
        fields[key] = value
    missing = [key for key in ("train_time", "step_avg") if key not in fields]
    if missing:
        raise RecordGateInputError(
            f"{where}: {line!r} lacks {', '.join(missing)}; progress lines read {PROGRESS_FORMAT!r}."
        )
    step = _integer(step_text, "step", where)
    total = _integer(total_text, "total steps", where)
    time_ms = _milliseconds(fields["train_time"], "train_time", where)
    _milliseconds(fields["step_avg"], "step_avg", where)
    loss = _loss(fields["val_loss"], where) if "val_loss" in fields else None
    return step, total, time_ms, loss


def _lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, cut off) for each non-blank line; cut off = the last line has no newline."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise RecordGateInputError(f"cannot read {path}: {err}") from err
    pieces = text.split("\n")
    return [(i + 1, piece, i == len(pieces) - 1) for i, piece in enumerate(pieces) if piece.strip()]


def _make_run(
    name: str, source: Path, vals: list[_Val], last_step: int | None, totals: set[int], failed: str | None
) -> Run:
    if len(totals) > 1:
        raise RecordGateInputError(
            f"{source} mixes total step counts {sorted(totals)}: one log must hold one run; split it."
        )
    total = next(iter(totals)) if totals else None
    curve = [(v.step, v.loss) for v in vals]
    finals = [v for v in vals if v.step == v.total_steps]
    if finals:
        final = finals[-1]
        return Run(name, source, total, final.loss, final.time_ms, curve)
    if failed is not None:
        reason = failed
    elif total is None:
        reason = "no progress line or event at all"
    else:
        reason = f"no final val at step {total}/{total} (last step logged: {last_step})"
    return Run(name, source, total, None, None, curve, not_finished=reason)


def read_text_log(path: Path, name: str | None = None) -> Run:
    """An upstream-format text log (an upstream ``*.txt`` log, or a run directory's ``log.txt``).

    Lines starting with ``step:`` are progress lines; everything else (versions, nvidia-smi, source) is
    skipped. A last line without a newline that does not parse was cut off mid-write and is ignored.
    """
    vals: list[_Val] = []
    totals: set[int] = set()
    last_step = None
    for lineno, line, cut_off in _lines(path):
        resumed = _RESUMED.match(line)
        if resumed:  # a resumed run continues here: what was logged after its step is superseded
            vals = [v for v in vals if v.step <= int(resumed["step"])]
            continue
        if not line.startswith("step:"):
            continue
        try:
            step, total, time_ms, loss = _parse_progress(line, f"{path}:{lineno}")
        except RecordGateInputError:
            if cut_off:
                break
            raise
        totals.add(total)
        last_step = step
        if loss is not None:
            vals.append(_Val(step, total, loss, time_ms))
    return _make_run(name or path.stem, path, vals, last_step, totals, failed=None)


def _json_int(event: dict, key: str, where: str) -> int:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordGateInputError(
            f"{where}: {event['event']} event field {key!r} must be a whole number, got {value!r}."
        )
    return value


def _json_time_ms(event: dict, key: str, where: str) -> float:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecordGateInputError(
            f"{where}: {event['event']} event field {key!r} must be a finite number, got {value!r}."
        )
    return float(value)


def _json_loss(event: dict, where: str) -> float:
    # A final validation names the loss the run gates on (track_1_short/endgame.py: the canonical-masked one
    # when the mask is on); its val_loss is that loss, and the gate reads it by that name.
    key = event.get("gate_reads", "val_loss")
    if not isinstance(key, str) or key not in event:
        raise RecordGateInputError(f"{where}: val event field 'gate_reads' names {key!r}, which it lacks.")
    value = event.get(key)
    if isinstance(value, str) and value.lower() in _NON_FINITE:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordGateInputError(f"{where}: val event field {key!r} must be a number, got {value!r}.")
    return float(value)


def read_events(path: Path, name: str) -> Run:
    """A run directory's ``events.jsonl`` (contract: track_1_short/run_log.py)."""
    vals: list[_Val] = []
    totals: set[int] = set()
    last_step = None
    failed = None
    for lineno, line, cut_off in _lines(path):
        where = f"{path}:{lineno}"
        try:
            event = json.loads(line)
        except json.JSONDecodeError as err:
            if cut_off:
                break
            raise RecordGateInputError(
                f"{where}: not a JSON object ({err.msg}); fix or remove that run."
            ) from err
        if not isinstance(event, dict) or "event" not in event:
            raise RecordGateInputError(f"{where}: a line must be a JSON object with an 'event' key.")
        kind = event["event"]
        if kind == "start":
            totals.add(_json_int(event, "total_steps", where))
        elif kind == "train":
            last_step = _json_int(event, "step", where)
        elif kind == "val":
            step = _json_int(event, "step", where)
            total = _json_int(event, "total_steps", where)
            vals.append(
                _Val(step, total, _json_loss(event, where), _json_time_ms(event, "train_time_ms", where))
            )
            totals.add(total)
            last_step = step
        elif kind == "resume":  # the run continues from a checkpoint: later steps logged before it are void
            step = _json_int(event, "step", where)
            vals = [v for v in vals if v.step <= step]
            failed = None
        elif kind == "end" and event.get("status") == "failed":
            failed = f"run ended with status 'failed' at step {event.get('step')}"
    return _make_run(name, path, vals, last_step, totals, failed)


def _is_run_dir(path: Path) -> bool:
    return (path / "events.jsonl").is_file() or (path / "log.txt").is_file()


def read_run_dir(path: Path) -> Run:
    """One of this project's run directories: ``events.jsonl`` when present, else ``log.txt``; its
    ``config.yaml`` too, when present (the target and the set's sameness come from it)."""
    if (path / "events.jsonl").is_file():
        run = read_events(path / "events.jsonl", path.name)
    else:
        run = read_text_log(path / "log.txt", path.name)
    run.config = read_config(path)
    return run


# ---------------------------------------------------------------------------------------------------------
# The runs' configs: the target, and one configuration per set
# ---------------------------------------------------------------------------------------------------------

# Keys that may differ between the runs of one set: the seed (what repeats vary) and where a run lives or how
# it reports, which change nothing it computes.
BOOKKEEPING_KEYS = ("seed", "run_name", "runs_root", "resume", "progress_bar", "progress_seconds", "data.dir",
                    "checkpoint.dir")  # fmt: skip


def read_config(run_dir: Path) -> dict | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise RecordGateInputError(f"{path} cannot be read as YAML ({err}); fix or remove that run.") from err
    if not isinstance(config, dict):
        raise RecordGateInputError(f"{path} is not a mapping of settings; fix or remove that run.")
    return config


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, path + "."))
        else:
            out[path] = value
    return out


def config_differences(runs: list[Run]) -> list[str]:
    """Dotted keys whose values differ between the runs' configs, bookkeeping keys left out."""
    flats = [_flat(r.config) for r in runs if r.config is not None]
    keys = sorted(set().union(*flats)) if flats else []
    ignored = lambda k: any(k == b or k.startswith(b + ".") for b in BOOKKEEPING_KEYS)  # noqa: E731
    return [k for k in keys if not ignored(k) and len({json.dumps(f.get(k)) for f in flats}) > 1]


def check_one_config(run_set: RunSet, label: str) -> None:
    """A set repeats one configuration: refuse runs whose configs differ in more than the seed."""
    differ = config_differences(run_set.runs)
    if differ:
        more = f" and {len(differ) - 12} more" if len(differ) > 12 else ""
        shown = ", ".join(differ[:12]) + more
        raise RecordGateInputError(
            f"{label} {run_set.directory} mixes configurations: its runs' config.yaml differ in {shown} "
            "(only the seed and where a run lives may differ). A set must repeat one configuration; move the "
            "odd runs out."
        )


def config_target(run_set: RunSet) -> tuple[float, str | None]:
    """(target, where it came from) for a set: its preset's ``smoke_target``, 3.28 on FineWeb, or 3.28 (from
    nowhere: None) for upstream logs, which have no config.yaml."""
    configs = [r.config for r in run_set.runs if r.config is not None]
    if not configs:
        return DEFAULT_TARGET, None
    config = configs[0]
    target, kind = config.get("smoke_target"), (config.get("data") or {}).get("kind")
    if target is not None:
        return float(target), "smoke_target in the runs' config.yaml"
    if kind == "shards":
        return DEFAULT_TARGET, "the record's, for runs on FineWeb"
    raise RecordGateInputError(
        f"{run_set.directory}: the runs' config.yaml sets no smoke_target and their data is not FineWeb "
        f"(data.kind={kind!r}), so there is no target to test against: pass --target LOSS."
    )


@dataclass
class RunSet:
    """Every run found in one directory, finished or not."""

    directory: Path
    runs: list[Run]

    @property
    def scored(self) -> list[Run]:
        """Finished with a finite loss: the runs the statistics describe."""
        return [r for r in self.runs if r.finished and not r.diverged]

    @property
    def diverged(self) -> list[Run]:
        return [r for r in self.runs if r.diverged]

    @property
    def excluded(self) -> list[Run]:
        return [r for r in self.runs if not r.finished]


def load_runs(directory: Path) -> RunSet:
    """The runs of ``directory``: its ``*.txt`` logs and its run sub-directories; the rest is skipped."""
    if not directory.is_dir():
        raise RecordGateInputError(
            f"{directory} is not a directory; pass the directory that holds the run logs."
        )
    if _is_run_dir(directory):
        raise RecordGateInputError(
            f"{directory} is one run directory (it holds events.jsonl or log.txt); a set needs repeated "
            "runs: pass the directory that holds the run directories."
        )
    runs = []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and _is_run_dir(entry):
            runs.append(read_run_dir(entry))
        elif entry.is_file() and entry.suffix == ".txt":
            runs.append(read_text_log(entry))
    if not runs:
        raise RecordGateInputError(
            f"no run logs in {directory}: expected upstream logs (*.txt) or run directories holding "
            "events.jsonl or log.txt."
        )
    return RunSet(directory, runs)


# ---------------------------------------------------------------------------------------------------------
# Statistics and the decision
# ---------------------------------------------------------------------------------------------------------


@dataclass
class SetStats:
    """The statistics of one set of finished runs. Losses in nats, times in seconds."""

    label: str  # "candidate" | "baseline"
    directory: str
    n: int  # finished runs with a finite loss: the sample the figures below describe
    runs: list[str]  # run names, in the order of losses and times_s
    total_steps: int
    losses: list[float]
    times_s: list[float]
    mean_loss: float
    std_loss: float  # sample std (n - 1)
    p_value: float  # one-sided one-sample t-test: mean loss < target
    mean_time_s: float
    std_time_s: float
    median_time_s: float
    min_time_s: float
    max_time_s: float
    excluded: list[dict[str, str]]  # {"run", "reason"}: did not finish
    diverged: list[str]  # finished with a non-finite loss; not in the figures above


def set_statistics(run_set: RunSet, label: str, target: float) -> SetStats:
    """Statistics of the finished runs; raises RecordGateInputError where they cannot be computed."""
    where = f"{label} {run_set.directory}"
    excluded = [{"run": r.name, "reason": r.not_finished} for r in run_set.excluded]
    listing = "; ".join(f"{e['run']}: {e['reason']}" for e in excluded)
    totals: dict[int, list[str]] = {}
    for r in run_set.runs:
        if r.total_steps is not None:
            totals.setdefault(r.total_steps, []).append(r.name)
    if len(totals) > 1:
        mix = "; ".join(f"{m} steps: {', '.join(names)}" for m, names in sorted(totals.items()))
        raise RecordGateInputError(
            f"{where} mixes step counts ({mix}): a set must repeat one configuration; move the odd runs out."
        )
    runs = run_set.scored
    if len(runs) < 2:
        left_out = [f"excluded: {listing}"] if listing else []
        if run_set.diverged:
            left_out.append(f"diverged: {', '.join(r.name for r in run_set.diverged)}")
        raise RecordGateInputError(
            f"{where} has {len(runs)} finished run(s) with a finite loss; a sample std and a t-test need at "
            "least 2: add runs" + (f" ({'; '.join(left_out)})." if left_out else ".")
        )
    losses = [r.final_loss for r in runs]
    if len(set(losses)) == 1:
        raise RecordGateInputError(
            f"{where}: all {len(runs)} runs have the same final val loss {losses[0]}, so the t-test is "
            "undefined; repeated runs need different seeds."
        )
    times_s = [r.final_time_ms / 1000.0 for r in runs]
    return SetStats(
        label=label,
        directory=str(run_set.directory),
        n=len(runs),
        runs=[r.name for r in runs],
        total_steps=runs[0].total_steps,
        losses=losses,
        times_s=times_s,
        mean_loss=statistics.fmean(losses),
        std_loss=statistics.stdev(losses),
        p_value=float(stats.ttest_1samp(losses, target, alternative="less").pvalue),
        mean_time_s=statistics.fmean(times_s),
        std_time_s=statistics.stdev(times_s),
        median_time_s=statistics.median(times_s),
        min_time_s=min(times_s),
        max_time_s=max(times_s),
        excluded=excluded,
        diverged=[r.name for r in run_set.diverged],
    )


@dataclass
class Comparison:
    """Candidate against baseline. Negative deltas: the candidate is lower (faster, lower loss)."""

    delta_time_s: float  # mean candidate - mean baseline
    speedup: float  # mean baseline time / mean candidate time
    welch_p_time: float  # one-sided Welch t-test: candidate time < baseline time
    welch_p_loss: float  # two-sided Welch t-test: candidate loss != baseline loss
    delta_loss: float  # mean candidate - mean baseline


def compare(candidate: SetStats, baseline: SetStats) -> Comparison:
    """Welch t-tests (unequal variances), as upstream record #89 reports them against its baseline."""
    return Comparison(
        delta_time_s=candidate.mean_time_s - baseline.mean_time_s,
        speedup=baseline.mean_time_s / candidate.mean_time_s,
        welch_p_time=float(
            stats.ttest_ind(candidate.times_s, baseline.times_s, equal_var=False, alternative="less").pvalue
        ),
        welch_p_loss=float(stats.ttest_ind(candidate.losses, baseline.losses, equal_var=False).pvalue),
        delta_loss=candidate.mean_loss - baseline.mean_loss,
    )


def format_p(p: float) -> str:
    """Four decimals as upstream prints p; scientific notation once that would read 0.0000."""
    if math.isnan(p):
        return "undefined"
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def decide(
    candidate: SetStats,
    baseline: SetStats | None,
    comparison: Comparison | None,
    target: float,
    alpha: float,
    systems_only: bool,
) -> tuple[bool, list[str]]:
    """(passed, reasons): one reason per criterion, prefixed 'pass:' or 'fail:', then notes ('note:')."""
    checks: list[tuple[bool, str]] = []
    if candidate.diverged:
        names = ", ".join(candidate.diverged)
        checks.append((False, f"candidate run(s) diverged (non-finite final val loss): {names}"))
    if systems_only:
        assert baseline is not None and comparison is not None  # run_gate enforces it
        same = comparison.welch_p_loss >= alpha
        text = (
            f"candidate losses {'are not' if same else 'are'} distinguishable from the baseline's "
            f"(mean {candidate.mean_loss:.5f} vs {baseline.mean_loss:.5f}): two-sided Welch "
            f"p = {format_p(comparison.welch_p_loss)} {'>=' if same else '<'} alpha {alpha}"
        )
        checks.append((same, text))
    else:
        below = candidate.p_value < alpha
        text = (
            f"mean val loss {candidate.mean_loss:.5f} {'is' if below else 'is not'} below the target "
            f"{target} at p < {alpha}: one-sided t-test p = {format_p(candidate.p_value)} (n = {candidate.n})"
        )
        checks.append((below, text))
    notes = []
    if comparison is not None:
        faster = comparison.welch_p_time < alpha
        text = (
            f"candidate {'is' if faster else 'is not'} faster than the baseline at p < {alpha}: "
            f"{candidate.mean_time_s:.3f} s vs {baseline.mean_time_s:.3f} s "
            f"({comparison.delta_time_s:+.3f} s, speedup {comparison.speedup:.4f}x), "
            f"one-sided Welch p = {format_p(comparison.welch_p_time)}"
        )
        checks.append((faster, text))
    else:
        notes.append("note: no baseline given: speed against the prior record was not checked")
    for s in (candidate, baseline):
        if s is not None and s.excluded:
            listing = "; ".join(f"{e['run']} ({e['reason']})" for e in s.excluded)
            notes.append(f"note: {len(s.excluded)} {s.label} run(s) did not finish, excluded: {listing}")
    if baseline is not None and baseline.diverged:
        names = ", ".join(baseline.diverged)
        notes.append(f"note: baseline run(s) diverged and are left out of its statistics: {names}")
    passed = all(ok for ok, _ in checks)
    return passed, [f"{'pass' if ok else 'fail'}: {text}" for ok, text in checks] + notes


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]
    target: float
    alpha: float
    systems_only: bool
    candidate: SetStats
    baseline: SetStats | None
    comparison: Comparison | None
    candidate_runs: RunSet
    baseline_runs: RunSet | None


def run_gate(
    candidate_dir: Path,
    baseline_dir: Path | None = None,
    target: float | None = None,
    alpha: float = DEFAULT_ALPHA,
    systems_only: bool = False,
) -> GateResult:
    """Read both sets, compute their statistics and decide. Raises RecordGateInputError on bad input.
    ``target`` None: the candidate runs' own (:func:`config_target`)."""
    if target is not None and not math.isfinite(target):
        raise RecordGateInputError(f"--target must be a finite loss, got {target}.")
    if not 0.0 < alpha < 1.0:
        raise RecordGateInputError(f"--alpha must lie strictly between 0 and 1, got {alpha}.")
    if systems_only and baseline_dir is None:
        raise RecordGateInputError("--systems-only compares losses with a baseline: pass --baseline DIR.")
    candidate_runs = load_runs(Path(candidate_dir))
    check_one_config(candidate_runs, "candidate")
    target_note = None
    if target is None:
        target, source = config_target(candidate_runs)
        if source is not None:
            target_note = f"note: target {target}: {source} (--target overrides it)"
    candidate = set_statistics(candidate_runs, "candidate", target)
    baseline_runs = baseline = comparison = None
    if baseline_dir is not None:
        baseline_runs = load_runs(Path(baseline_dir))
        check_one_config(baseline_runs, "baseline")
        baseline = set_statistics(baseline_runs, "baseline", target)
        comparison = compare(candidate, baseline)
    passed, reasons = decide(candidate, baseline, comparison, target, alpha, systems_only)
    reasons += [target_note] if target_note else []
    return GateResult(
        passed=passed,
        reasons=reasons,
        target=target,
        alpha=alpha,
        systems_only=systems_only,
        candidate=candidate,
        baseline=baseline,
        comparison=comparison,
        candidate_runs=candidate_runs,
        baseline_runs=baseline_runs,
    )


# ---------------------------------------------------------------------------------------------------------
# Reports: stdout, JSON, statistics.md, plot
# ---------------------------------------------------------------------------------------------------------


def _set_name(s: SetStats) -> str:
    """A set's name in reports: its directory's name."""
    return Path(s.directory).name or s.label


def _finite_or_none(value: Any) -> Any:
    # JSON has no NaN: an undefined p-value (both sets without spread) is written as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def result_to_json(result: GateResult) -> dict[str, Any]:
    """The --json document: passed, reasons, candidate, baseline, comparison (null without a baseline)."""

    def set_json(s: SetStats | None) -> dict[str, Any] | None:
        if s is None:
            return None
        return _finite_or_none({k: v for k, v in vars(s).items() if k != "label"})

    return {
        "passed": result.passed,
        "reasons": result.reasons,
        "target": result.target,
        "alpha": result.alpha,
        "systems_only": result.systems_only,
        "candidate": set_json(result.candidate),
        "baseline": set_json(result.baseline),
        "comparison": _finite_or_none(vars(result.comparison)) if result.comparison is not None else None,
    }


def render_summary(result: GateResult) -> str:
    """The readable summary printed on stdout: each set, the comparison, the decision and its reasons."""
    lines = []
    for s in (result.candidate, result.baseline):
        if s is None:
            continue
        lines += [
            f"{s.label}: {s.directory}: {s.n} runs at step {s.total_steps}/{s.total_steps}"
            f" ({len(s.excluded)} excluded, {len(s.diverged)} diverged)",
            f"  val loss   mean {s.mean_loss:.5f}  std {s.std_loss:.5f}  min {min(s.losses):.4f}  "
            f"max {max(s.losses):.4f}  p(mean < {result.target}) = {format_p(s.p_value)}",
            f"  train time mean {s.mean_time_s:.3f} s  std {s.std_time_s:.3f} s  "
            f"median {s.median_time_s:.3f} s  range {s.min_time_s:.3f} - {s.max_time_s:.3f} s",
        ]
        lines += [f"  excluded: {e['run']}: {e['reason']}" for e in s.excluded]
    c = result.comparison
    if c is not None:
        lines.append(
            f"comparison: time {c.delta_time_s:+.3f} s (speedup {c.speedup:.4f}x, Welch p(faster) = "
            f"{format_p(c.welch_p_time)}); loss {c.delta_loss:+.5f} "
            f"(Welch p(differs) = {format_p(c.welch_p_loss)})"
        )
    mode = ", systems only" if result.systems_only else ""
    lines.append(
        f"{'PASS' if result.passed else 'FAIL'} (target {result.target}, alpha {result.alpha}{mode})"
    )
    lines += [f"  {r}" for r in result.reasons]
    return "\n".join(lines)


def _set_markdown(s: SetStats, runs: RunSet, target: float, level: str = "##") -> list[str]:
    by_name = {r.name: r for r in runs.runs}
    out = [
        f"{s.n} runs, step {s.total_steps}/{s.total_steps}.",
        "",
        "| Run | val_loss | train_time |",
        "|---|---|---|",
    ]
    out += [
        f"| {name} | {by_name[name].final_loss:.4f} | {by_name[name].final_time_ms:.0f}ms |"
        for name in s.runs
    ]
    if s.diverged:
        out += ["", f"Diverged (non-finite final val loss): {', '.join(s.diverged)}."]
    if s.excluded:
        out += [
            "",
            "Excluded (did not finish): "
            + "; ".join(f"{e['run']} ({e['reason']})" for e in s.excluded)
            + ".",
        ]
    ms = [t * 1000.0 for t in s.times_s]
    out += [
        "",
        f"{level} Summary",
        "",
        "|  | mean | std | min | max |",
        "|---|---|---|---|---|",
        f"| val_loss | {s.mean_loss:.5f} | {s.std_loss:.5f} | {min(s.losses):.4f} | {max(s.losses):.4f} |",
        f"| train_time (ms) | {s.mean_time_s * 1000:.1f} | {s.std_time_s * 1000:.1f} | "
        f"{min(ms):.0f} | {max(ms):.0f} |",
        "",
        f"Median train_time: {s.median_time_s * 1000:.1f}ms.",
        "",
        f"p(val_loss < {target}) = **{format_p(s.p_value)}** (one-sided one-sample t-test)",
    ]
    return out


def render_markdown(result: GateResult) -> str:
    """A statistics.md in the layout of upstream record folders, with the gate's decision at the end."""
    cand, base, c = result.candidate, result.baseline, result.comparison
    name = _set_name(cand)
    out = [f"# {name} statistics", ""] + _set_markdown(cand, result.candidate_runs, result.target)
    if base is not None and c is not None:
        out += [
            "",
            "## vs baseline",
            "",
            f"|  | baseline (n={base.n}) | {name} (n={cand.n}) | delta |",
            "|---|---|---|---|",
            f"| val_loss mean | {base.mean_loss:.5f} | {cand.mean_loss:.5f} | {c.delta_loss:+.5f} |",
            f"| train_time mean (ms) | {base.mean_time_s * 1000:.1f} | {cand.mean_time_s * 1000:.1f} | "
            f"**{c.delta_time_s * 1000:+.1f}** |",
            "",
            f"Speedup {c.speedup:.4f}x. Welch t-tests: time, one-sided (candidate faster), p = "
            f"{format_p(c.welch_p_time)}; val_loss, two-sided, p = {format_p(c.welch_p_loss)}.",
            "",
            "### Baseline runs",
            "",
        ] + _set_markdown(base, result.baseline_runs, result.target, level="####")
    mode = ", systems only" if result.systems_only else ""
    out += [
        "",
        "## Decision",
        "",
        f"**{'PASS' if result.passed else 'FAIL'}** (target {result.target}, alpha {result.alpha}{mode})",
        "",
    ]
    out += [f"- {r}" for r in result.reasons]
    return "\n".join(out) + "\n"


def _spread(n: int, width: float = 0.36) -> list[float]:
    """x offsets for n points of one set: evenly across `width`, so equal values stay visible."""
    return [0.0] if n == 1 else [-width / 2 + width * i / (n - 1) for i in range(n)]


def _plot_curves(ax, zoom, sets: list, target: float) -> None:
    """Every finished run's val-loss curve (log y) above a linear zoom on the last 40% of the steps."""
    from matplotlib.ticker import ScalarFormatter

    curves = [
        (s, run, color)
        for s, runs, color in sets
        for run in runs.runs
        if run.finished and len(run.curve) >= 2
    ]
    ax.set_title("val loss curves")
    if not curves:
        ax.text(
            0.5,
            0.5,
            "the logs hold no intermediate val losses",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        for a in (ax, zoom):
            a.set_axis_off()
        return
    total = max(run.total_steps for _, run, _ in curves)
    labelled = set()
    for s, run, color in curves:
        ax.plot(*zip(*run.curve), color=color, linewidth=0.8, alpha=0.6, marker=".",
                label=None if s.label in labelled else s.label)  # fmt: skip
        labelled.add(s.label)
        tail = [(step, loss) for step, loss in run.curve if step >= 0.6 * total]
        if tail:
            zoom.plot(*zip(*tail), color=color, linewidth=0.8, alpha=0.6, marker=".")
    ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target}")
    zoom.axhline(target, color="tab:red", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel("val loss (log scale)")
    ax.legend(loc="upper right", fontsize=8)
    zoom.set_xlabel(f"step (zoom on steps >= {0.6 * total:.0f})")
    zoom.set_ylabel("val loss")
    for a in (ax, zoom):
        a.grid(alpha=0.3, which="both")


def error_bar(mean: float, std: float, floor: float = 0.0) -> list[list[float]]:
    """matplotlib's yerr for mean ± std, its lower arm cut at ``floor``: times and losses are never negative,
    and a bar reaching below 0 s (a wide spread over few runs) would draw an impossible value."""
    return [[max(0.0, min(std, mean - floor))], [std]]


def _tick(s: SetStats) -> str:
    """x tick of a set: its role, its directory's name, n, and what was left out of n."""
    counts = [f"n={s.n}"]
    counts += [f"{len(s.excluded)} unfinished"] if s.excluded else []
    counts += [f"{len(s.diverged)} diverged"] if s.diverged else []
    name = _set_name(s)
    return f"{s.label}\n" + (f"{name} " if name != s.label else "") + f"({', '.join(counts)})"


CURVELESS_FIGSIZE = (16 * 2 / 3.5, 5.2)  # the two per-run panels at the width they have beside the curves


def write_plot(result: GateResult, path: Path) -> None:
    """Per-run final loss against the target, per-run time, and the val-loss curves; baseline left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = []
    if result.baseline is not None:
        sets.append((result.baseline, result.baseline_runs, "tab:gray"))
    sets.append((result.candidate, result.candidate_runs, "tab:blue"))
    # The curve panels only when some run logged intermediate val losses: an empty panel explains nothing.
    has_curves = any(run.finished and len(run.curve) >= 2 for _, runs, _ in sets for run in runs.runs)
    fig = plt.figure(figsize=(16, 5.2) if has_curves else CURVELESS_FIGSIZE, layout="constrained")
    if has_curves:
        grid = fig.add_gridspec(2, 3, width_ratios=[1, 1, 1.5], height_ratios=[1.2, 1])
        ax_curve, ax_zoom = fig.add_subplot(grid[0, 2]), fig.add_subplot(grid[1, 2])
    else:
        grid = fig.add_gridspec(2, 2)
    ax_loss, ax_time = fig.add_subplot(grid[:, 0]), fig.add_subplot(grid[:, 1])
    for i, (s, _, color) in enumerate(sets):
        xs = [i + dx for dx in _spread(s.n)]
        for ax, values, mean, std in ((ax_loss, s.losses, s.mean_loss, s.std_loss),
                                      (ax_time, s.times_s, s.mean_time_s, s.std_time_s)):  # fmt: skip
            ax.scatter(xs, values, color=color, s=22, alpha=0.8, zorder=3)
            ax.errorbar(i + 0.3, mean, yerr=error_bar(mean, std), fmt="D", color="black", capsize=4, zorder=4)
    ax_loss.axhline(result.target, color="tab:red", linestyle="--", label=f"target {result.target}")
    ax_loss.errorbar([], [], yerr=[], fmt="D", color="black", capsize=4, label="mean ± sample std")
    ax_loss.set_title("final val loss per run")
    ax_loss.set_ylabel("val loss (nats)")
    ax_loss.legend(loc="best", fontsize=8)
    ax_time.set_title("train time per run")
    ax_time.set_ylabel("train_time at the final val (s)")
    for ax in (ax_loss, ax_time):
        ax.set_xticks(range(len(sets)), [_tick(s) for s, _, _ in sets], fontsize=8)
        ax.set_xlim(-0.5, len(sets) - 0.5)
        ax.grid(axis="y", alpha=0.3)
    if has_curves:
        _plot_curves(ax_curve, ax_zoom, sets, result.target)
    mode = ", systems only" if result.systems_only else ""
    verdict = "PASS" if result.passed else "FAIL"
    fig.suptitle(f"record gate: {verdict} (target {result.target}, alpha {result.alpha}{mode})",
                 color="tab:green" if result.passed else "tab:red")  # fmt: skip
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="record_gate",
        description="Decide from run logs whether a change reproduces the record. "
        "Exit 0 pass, 1 fail, 2 bad input.",
    )
    p.add_argument("candidate", type=Path, help="directory of the candidate's run logs")
    p.add_argument("--baseline", type=Path, help="directory of the baseline re-run's logs (same hardware)")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="val loss target (default: the runs' smoke_target from their config.yaml; "
        f"{DEFAULT_TARGET} on FineWeb and for upstream logs)",
    )
    p.add_argument(
        "--alpha", type=float, default=DEFAULT_ALPHA, help="significance level (default %(default)s)"
    )
    p.add_argument(
        "--systems-only",
        action="store_true",
        help="a change that does not touch the ML: losses must match the baseline's instead of the "
        "target test",
    )
    p.add_argument("--json", type=Path, help="write the statistics and decision as JSON")
    p.add_argument("--markdown", type=Path, help="write a statistics.md")
    p.add_argument("--plot", type=Path, help="write a PNG of losses, times and loss curves")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run_gate(args.candidate, args.baseline, args.target, args.alpha, args.systems_only)
    except RecordGateInputError as err:
        print(f"record_gate: bad input: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(render_summary(result))
    try:
        if args.json is not None:
            args.json.write_text(json.dumps(result_to_json(result), indent=2, allow_nan=False) + "\n")
        if args.markdown is not None:
            args.markdown.write_text(render_markdown(result))
        if args.plot is not None:
            write_plot(result, args.plot)
    except OSError as err:
        print(f"record_gate: cannot write an output: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_PASS if result.passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
