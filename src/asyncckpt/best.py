"""The best steps by a recorded metric: what ``keep_best`` spares from retention and what
``best_step()`` answers.

A save records its metrics in its manifest (``save_async(metrics={"val_loss": 2.31})``);
a committed step's manifest never changes while its directory lives, so each step's are
read once and kept (a retention after every save would otherwise parse every kept
step's manifest again).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .commit import files_amiss, new_token, step_dir_name, step_of_dir_name, still_there
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPermissionError,
    CheckpointSaveError,
    few,
)
from .manifest import MANIFEST_NAME, METRIC_MODES, compact_json, is_sealed, metrics_text, seal
from .reader import damage_is_certain, read_manifest_summary
from .storage import LocalStorage, ReadStorage, Storage

log = logging.getLogger(__name__)

MODES = METRIC_MODES
# A committed step's metrics recorded after its save (record_metrics): its manifest never
# changes, so they go beside it, in a file of their own sealed with its digest
LATER_METRICS_NAME = "metrics.json"
_LATER_FORMAT = "asyncckpt-metrics"
_MAX_LATER_BYTES = 1 << 20


def read_later_metrics(step_dir: Path, storage: ReadStorage) -> dict[str, float]:
    """The metrics recorded for a committed step after its save ({} where none were).

    Raises CheckpointCorruptError where the file is cut short, edited (its digest does
    not match) or no such file, CheckpointPermissionError where this user may not read
    it; another OSError as the storage raises it."""
    path = step_dir / LATER_METRICS_NAME
    try:
        raw = storage.read_bytes(path, _MAX_LATER_BYTES)
    except FileNotFoundError:
        return {}
    except PermissionError as exc:
        raise CheckpointPermissionError(
            f"{path} cannot be read by this user ({exc.strerror or exc}): the metrics recorded "
            "after the save (record_metrics) are not counted; give it read access",
            path=str(path)) from exc
    except (ValueError, CheckpointError) as exc:  # over the limit; a directory, a FIFO
        raise CheckpointCorruptError(f"{path} cannot be read ({exc})", path=str(path)) from exc
    problem = None
    if not is_sealed(raw):
        problem = "its digest does not match its contents (cut short, or edited)"
    else:
        doc = json.loads(raw)
        got = doc.get("metrics") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or doc.get("format") != _LATER_FORMAT:
            problem = f"it is no {_LATER_FORMAT} file"
        elif (named := step_of_dir_name(step_dir.name)) is not None and doc.get(
                "step") != named:  # (copied from another step's directory: a trial)
            problem = (f"it holds the metrics of step {doc.get('step')!r:.20}, not of step "
                       f"{named} (copied from another step?)")
        elif not isinstance(got, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in got.items()):
            problem = "its metrics are not names to numbers"
        else:
            try:
                return {k: float(v) for k, v in got.items()}
            except ValueError:
                problem = "its metrics are not names to numbers"
    raise CheckpointCorruptError(
        f"{path}: {problem}: the metrics recorded after the save (record_metrics) are not "
        "counted; record them again (the step's data is not in question)", path=str(path))


def write_later_metrics(step_dir: Path, step: int, storage: Storage,
                        metrics: Mapping[str, float]) -> None:
    """Replace ``step_dir``'s later metrics with ``metrics``, atomically: a file written
    and made durable beside it, then renamed over it (a reader sees the old or the new).
    An OSError before the rename changed nothing; one of the directory's fsync after it
    is raised as NotDurableYet (the new file is there, perhaps not durable)."""
    body = seal(compact_json({"format": _LATER_FORMAT, "step": step,
                              "recorded_unix": time.time(),
                              "metrics": metrics_text(metrics)}).encode("ascii"))
    tmp = step_dir / f"{_LATER_TMP}{new_token()}"
    try:
        storage.write_bytes(tmp, body)
        storage.rename(tmp, step_dir / LATER_METRICS_NAME)
    except BaseException:
        _remove_later_tmp(tmp, storage)
        raise
    try:
        storage.fsync_dir(step_dir)
    except OSError as exc:
        raise NotDurableYet(exc.errno, exc.strerror or str(exc)) from exc


class NotDurableYet(OSError):
    """A metrics.json renamed into place whose directory's fsync failed."""


_LATER_TMP = f".{LATER_METRICS_NAME}.tmp-"  # (a metrics.json being written)


def sweep_later_tmp(step_dir: Path, storage: Storage) -> None:
    """Remove what writes of ``step_dir``'s metrics.json left (a process killed between
    its write and its rename). Call with the ranking lock held: no write is then under
    way (best effort: errors are ignored)."""
    with contextlib.suppress(OSError):
        for name in storage.listdir(step_dir):
            if name.startswith(_LATER_TMP):
                _remove_later_tmp(step_dir / name, storage)


def _remove_later_tmp(tmp: Path, storage: Storage) -> None:
    with contextlib.suppress(OSError):
        if isinstance(storage, LocalStorage):
            os.unlink(tmp)
        else:  # (the protocol's one removal: a path and what it holds)
            storage.remove_tree(tmp)


def checked_metrics(metrics: object) -> dict[str, float]:
    """``save_async``'s ``metrics=`` as names to floats, or CheckpointConfigError naming
    the entry that is not a name and a real number. NaN and infinities are taken (a
    diverged run's loss): they rank last."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise CheckpointConfigError(
            f"metrics={metrics!r:.80}: pass a mapping of names to numbers, e.g. "
            "metrics={'val_loss': 2.31}")
    out: dict[str, float] = {}
    for name, v in metrics.items():
        if not isinstance(name, str) or not name:
            raise CheckpointConfigError(f"metrics: the name {name!r:.80} is not a non-empty str")
        out[name] = _number(name, v)
    return out


def merged_metrics(own: Mapping[str, float], records: Sequence[dict[str, Any]], step: int,
                   warned: set[str] | None = None) -> dict[str, float]:
    """The metrics a group's save records: the coordinator's ``own``, and each name that
    only other ranks passed, the lowest such rank's value (the ranks that know a metric
    may be any: the last stage of a pipeline computes the loss). Takes the metrics out of
    ``records`` (every rank's, in rank order, the coordinator's first; a rank's as
    ``manifest.metrics_text`` writes them); a malformed entry
    is CheckpointSaveError. A name passed with different values (each rank's own loss)
    is warned of once per name in ``warned``."""
    def parse(text: Any) -> float | None:
        try:
            return float(text) if isinstance(text, str) else None
        except ValueError:
            return None

    return _merged(own, records, step, warned, "metrics", "metric", "number", parse,
                   lambda a, b: a == b or (math.isnan(a) and math.isnan(b)),
                   "all-reduce it first")


def merged_metadata(own: Mapping[str, str], records: Sequence[dict[str, Any]], step: int,
                    warned: set[str] | None = None) -> dict[str, str]:
    """The ``metadata=`` a group's save records, merged as :func:`merged_metrics` merges
    metrics: the coordinator's, and each key only other ranks passed, from the lowest
    such rank (a rank's record holds its own as ``"metadata"``)."""
    return _merged(own, records, step, warned, "metadata", "metadata key", "string",
                   lambda text: text if isinstance(text, str) else None,
                   lambda a, b: a == b, "pass the group's value")


def _merged(own: Mapping[str, Any], records: Sequence[dict[str, Any]], step: int,
            warned: set[str] | None, field: str, what: str, kind: str,
            parse: Callable[[Any], Any], same: Callable[[Any, Any], bool],
            advice: str) -> dict[str, Any]:
    aborted = f"step {step} aborted, nothing committed"
    out = dict(own)
    first = records[0].get("rank", 0) if records else 0
    by: dict[str, Any] = dict.fromkeys(own, first)  # the rank whose value is recorded
    for rec in records:
        theirs = rec.pop(field, None)
        if theirs is None:
            continue
        if not isinstance(theirs, dict):
            raise CheckpointSaveError(f"{aborted}: rank {rec.get('rank')!r:.20}'s record "
                                      f"holds {field} {theirs!r:.80}, which are no mapping")
        for name, text in theirs.items():
            value = parse(text)
            if not isinstance(name, str) or not name or value is None:
                raise CheckpointSaveError(
                    f"{aborted}: rank {rec.get('rank')!r:.20}'s record holds the {what} "
                    f"{name!r:.80} = {text!r:.40}, which is no name and {kind}")
            if name not in out:
                out[name], by[name] = value, rec.get("rank")
            elif warned is not None and name not in warned and not same(value, out[name]):
                warned.add(name)
                log.warning("step %d: ranks passed different values of %s %r (rank %s: "
                            "%r, rank %s: %r): rank %s's is recorded. Pass one value on every "
                            "rank that passes the %s (%s)", step, what, name, by[name],
                            out[name], rec.get("rank"), value, by[name], what, advice)
    return out


def _number(name: str, v: Any) -> float:
    wrong = CheckpointConfigError(
        f"metrics[{name!r}] = {v!r:.80}: pass a real number (a float, an int, a 0-dim "
        "tensor or a numpy scalar)")
    try:
        item = getattr(v, "item", None)  # a 0-dim tensor or a numpy scalar
        if not isinstance(v, numbers.Real) and callable(item) and getattr(v, "ndim", None) == 0:
            v = item()  # (a meta tensor has none: RuntimeError)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise wrong
        return float(v)  # (an int past float's range: OverflowError; a timedelta64: TypeError)
    except OverflowError as exc:  # (a number, but past a float's range: say so)
        raise CheckpointConfigError(
            f"metrics[{name!r}] = {v!r:.80}: out of a float's range (metrics are recorded "
            "as floats); pass float('inf') for a value beyond it") from exc
    except (ArithmeticError, TypeError, ValueError, RuntimeError) as exc:
        raise wrong from exc


def check_ranking(metric: object, mode: object, *, unset: bool = False) -> None:
    """``best_metric`` (None: not given) and ``best_mode`` (None too with ``unset``: as
    the steps recorded it), or CheckpointConfigError."""
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise CheckpointConfigError(
            f"best_metric={metric!r:.80}: name the metric that saves record, e.g. "
            "best_metric='val_loss' with save_async(..., metrics={'val_loss': loss})")
    if mode not in MODES and not (unset and mode is None):
        raise CheckpointConfigError(
            f"best_mode={mode!r:.40}: use 'min' (a loss) or 'max' (an accuracy)"
            + (", or None: as the root's steps recorded it, else 'min'" if unset else ""))


@dataclass(frozen=True)
class Ranking:
    """Which metric makes a step best, and whether less is better."""

    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        check_ranking(self.metric, self.mode)

    def best(self, scores: Mapping[int, float], count: int | None = None) -> list[int]:
        """The steps of ``scores`` (step -> value), best first, the first ``count`` of
        them. NaN ranks last; of equal values the newer step ranks first."""
        sign = 1.0 if self.mode == "min" else -1.0
        order = sorted(scores, key=lambda s: (math.isnan(scores[s]),
                                              sign * scores[s] if not math.isnan(scores[s])
                                              else 0.0, -s))
        return order if count is None else order[:count]


class StepMetrics:
    """Each committed step's metrics under one root, read from its manifest once.

    Thread-safe: retention asks on the writer thread, ``best_step()`` on the caller's.
    A step whose manifest cannot be read is not kept (asked again next time) and counts
    as one without metrics. A step number may be saved again after its directory went
    (a rollback, by this checkpointer or another process; a step deleted by hand): on
    the local filesystem, what is known of a step is tied to its manifest file (inode,
    size, time), so a replaced step is read again; other storages are trusted by step.
    The metrics recorded after a save (``metrics.json``, which ``record_metrics``
    replaces) are known apart, tied to that file (and read again where it was changed in
    the last seconds, whose times may not tell two changes apart; on other storages,
    read at every ask).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # step -> (identity, its metrics, its metric_modes)
        self._known: dict[int, tuple[object, dict[str, float], dict[str, str]]] = {}
        # step -> (identity, its files' sizes): of the committed steps (see keep_files)
        self._files: dict[int, tuple[object, dict[str, int]]] = {}
        self._committed: frozenset[int] = frozenset()  # as the last retention found them
        self._told: set[tuple[int, str]] = set()  # later metrics files warned of
        # step -> (its metrics.json's identity, the metrics it holds): see _later_of
        self._later_known: dict[int, tuple[object, dict[str, float]]] = {}
        self._unreadable: set[int] = set()  # steps whose metrics.json cannot be read
        self._manifest_unsure: set[int] = set()  # manifest not readable now (an ESTALE)

    def note(self, root: Path, step: int, storage: ReadStorage,
             metrics: Mapping[str, float], modes: Mapping[str, str] | None = None) -> None:
        """What a save committed as ``step`` recorded (no need to read it back)."""
        ident = _identity(root, step, storage)
        with self._lock:
            self._known[step] = (ident, dict(metrics), dict(modes or {}))

    def note_files(self, root: Path, step: int, storage: ReadStorage) -> None:
        """The sizes of the files a save just committed as ``step`` (checked as it
        committed them): no need to read its manifest for them later (see amiss)."""
        if not isinstance(storage, LocalStorage):
            return
        step_dir = root / step_dir_name(step)
        try:
            sizes = {e.name: e.stat().st_size for e in os.scandir(step_dir)  # (the shards)
                     if e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False)}
        except OSError:
            return
        self._remember(step, _identity(root, step, storage), sizes)

    def _remember(self, step: int, ident: object, sizes: dict[str, int]) -> None:
        with self._lock:
            self._files[step] = (ident, sizes)

    def keep_files(self, steps: Iterable[int]) -> None:
        """Forget the file sizes of the steps not in ``steps`` (the committed ones): a
        long run deletes thousands."""
        keep = set(steps)
        with self._lock:
            for s in [s for s in self._files if s not in keep]:
                del self._files[s]
            self._committed = frozenset(keep)

    def committed(self) -> frozenset[int]:
        """The committed steps the last retention found (``keep_files``): still listed,
        they are committed still (their directories need not be looked into again)."""
        with self._lock:
            return self._committed

    def amiss(self, root: Path, storage: ReadStorage, step: int) -> bool:
        """Whether committed ``step`` has a file missing or not of its size (a stat each;
        its manifest read once), or a manifest that cannot be read: what best_step() and
        ``ls`` pass over, and what retention must not keep in an intact step's place
        before a load marks it (a trial's cut-short best step was kept, and the intact
        one best_step() named deleted). False where the storage is not local."""
        if not isinstance(storage, LocalStorage):
            return False
        ident = _identity(root, step, storage)
        with self._lock:
            got = self._files.get(step)
        sizes = got[1] if got is not None and got[0] == ident else None
        if sizes is None:
            try:
                summary = read_manifest_summary(root / step_dir_name(step), storage)
            except (CheckpointError, OSError) as exc:
                if not damage_is_certain(exc):  # (see damage_is_certain)
                    self._unsure(step, exc)
                    return False
                return still_there(root, step_dir_name(step), storage)  # (gone: no verdict)
            sizes = {n: f.bytes for n, f in summary.files.items()}
            self._remember(step, ident, sizes)
        return bool(files_amiss(root / step_dir_name(step), sizes, sure=True))

    def _first_time(self, step: int, exc: BaseException) -> bool:
        """Whether ``exc`` of ``step`` is told for the first time (a warning is given once
        per step and error)."""
        said = (step, str(exc))
        with self._lock:
            first = said not in self._told
            self._told.add(said)
        return first

    def _unsure(self, step: int, exc: BaseException) -> None:
        """Warn (once per step and error) that ``step``'s manifest cannot be read now, for
        a reason that says nothing of its bytes: it is kept, and counted as intact (one
        warning: _saved's, where keep_best read its metrics first, is of the same cause)."""
        if self._first_time(step, exc):
            log.warning("step %d's manifest cannot be read now (%s: %s); retention keeps the "
                        "step and counts it as intact until a read says otherwise", step,
                        type(exc).__name__, exc)

    def of(self, root: Path, step: int, storage: ReadStorage) -> dict[str, float]:
        """The metrics committed ``step`` recorded ({} where its manifest cannot be read)."""
        return self._read(root, step, storage)[0]

    def modes_of(self, root: Path, step: int, storage: ReadStorage) -> dict[str, str]:
        """Which way each metric ranks, as committed ``step`` recorded it (its manifest
        alone: no metrics.json read)."""
        return self._saved(root, step, storage)[1]

    def recorded_mode(self, root: Path, storage: ReadStorage, steps: Iterable[int],
                      metric: str) -> tuple[str, int] | None:
        """The way ``metric`` ranks as the newest of ``steps`` that recorded one says,
        and that step; None where none did (steps saved before the library recorded it,
        or by a checkpointer without best_metric)."""
        for s in sorted(steps, reverse=True):
            mode = self.modes_of(root, s, storage).get(metric)
            if mode is not None:
                return mode, s
        return None

    def recorded_modes(self, root: Path, storage: ReadStorage, steps: Iterable[int],
                       metric: str) -> dict[str, list[int]]:
        """Each way ``metric`` ranks that ``steps`` recorded, and the steps that did,
        newest first."""
        out: dict[str, list[int]] = {}
        for s in sorted(steps, reverse=True):
            mode = self.modes_of(root, s, storage).get(metric)
            if mode is not None:
                out.setdefault(mode, []).append(s)
        return out

    def forget_later(self, step: int) -> None:
        """Read ``step``'s metrics recorded after the save again at the next ask (this
        process recorded some)."""
        with self._lock:
            self._later_known.pop(step, None)

    def _read(self, root: Path, step: int, storage: ReadStorage
              ) -> tuple[dict[str, float], dict[str, str]]:
        saved, modes = self._saved(root, step, storage)
        later = self._later_of(root, step, storage) if saved is not None else {}
        if not later:
            return saved or {}, modes
        # (the save's own first: record_metrics adds no name it recorded)
        return {**later, **(saved or {})}, modes

    def _saved(self, root: Path, step: int, storage: ReadStorage
               ) -> tuple[dict[str, float] | None, dict[str, str]]:
        """What ``step``'s save recorded (its manifest's metrics; None where that cannot be
        read) and its metric_modes."""
        ident = _identity(root, step, storage)
        with self._lock:
            got = self._known.get(step)
        if got is not None and got[0] == ident:
            if self._manifest_unsure:
                with self._lock:
                    self._manifest_unsure.discard(step)
            return got[1], got[2]
        try:
            summary = read_manifest_summary(root / step_dir_name(step), storage)
            metrics, modes = summary.metrics, summary.metric_modes
        except (CheckpointError, OSError) as exc:
            # (deleted since it was listed, by a saver's keep_last: no step, no warning; a
            # trial's monitor beside a trainer logged 229 of them)
            # (CheckpointNotFoundError is a FileNotFoundError)
            gone = isinstance(exc, FileNotFoundError) and not still_there(
                root, step_dir_name(step), storage)
            if gone:
                return None, {}
            if not damage_is_certain(exc):
                # (an ESTALE, an EIO, a permission: its metrics may be the best; keep_best
                # keeps it as it keeps a step whose metrics.json cannot be read, until they
                # can be: a review's ESTALE had the best step deleted)
                with self._lock:
                    self._manifest_unsure.add(step)
                if self._first_time(step, exc):
                    log.warning("step %d's metrics cannot be read now (%s: %s); keep_best keeps "
                                "the step until they can be read", step, type(exc).__name__,
                                exc)
                return None, {}
            log.warning("step %d's metrics cannot be read (%s: %s); it counts as a step "
                        "without metrics", step, type(exc).__name__, exc)
            return None, {}
        with self._lock:
            self._known[step] = (ident, metrics, modes)
            self._manifest_unsure.discard(step)
        if ident is not None:  # (read once: the sizes too, for retention's amiss)
            self._remember(step, ident, {n: f.bytes for n, f in summary.files.items()})
        return metrics, modes

    def _later_of(self, root: Path, step: int, storage: ReadStorage) -> dict[str, float]:
        """The metrics recorded for ``step`` after its save, read again only where its
        metrics.json may have changed (see _later_identity)."""
        ident = _later_identity(root, step, storage)
        with self._lock:
            got = self._later_known.get(step)
        if ident is not None and got is not None and got[0] == ident:
            return got[1]
        later = self._later(root, step, storage)
        if ident is not None:
            with self._lock:
                self._later_known[step] = (ident, later)
        return later

    def _later(self, root: Path, step: int, storage: ReadStorage) -> dict[str, float]:
        """``read_later_metrics`` of ``step``; a file that cannot be read is warned of
        (once per step and file) and counts as none: the save's own metrics still count
        (an evaluator's file this user may not read hid them: a review)."""
        try:
            got = read_later_metrics(root / step_dir_name(step), storage)
        except (CheckpointCorruptError, CheckpointPermissionError, OSError) as exc:
            if isinstance(exc, FileNotFoundError):  # (the step went meanwhile)
                return {}
            with self._lock:
                self._unreadable.add(step)
            if self._first_time(step, exc):
                log.warning("step %d: %s (keep_best keeps the step until they can be read)",
                            step, exc if isinstance(exc, CheckpointError) else (
                                f"{root / step_dir_name(step) / LATER_METRICS_NAME} cannot "
                                f"be read ({exc}): the metrics recorded after the save are "
                                "not counted"))
            return {}
        with self._lock:
            self._unreadable.discard(step)
        return got

    def unreadable(self, steps: Iterable[int]) -> set[int]:
        """Those of ``steps`` whose metrics recorded after the save could not be read when
        last asked, or whose manifest could not be, for a reason that says nothing of its
        bytes: keep_best keeps them (a trial's hand-corrected metrics.json of the best
        step had it deleted at the next save, before it could be recorded again; a
        review's ESTALE on the best step's manifest, alike)."""
        with self._lock:
            return (self._unreadable | self._manifest_unsure).intersection(steps)

    def scores(self, root: Path, storage: ReadStorage, steps: Iterable[int],
               metric: str) -> dict[int, float]:
        """``metric``'s value at each of ``steps`` (every committed step) that recorded
        it. The steps that are gone are forgotten (a long run deletes thousands)."""
        steps = set(steps)
        out = {}
        for s in steps:
            v = self.of(root, s, storage).get(metric)
            if v is not None:
                out[s] = v
        with self._lock:
            for s in [s for s in self._known if s not in steps]:
                del self._known[s]
            for s in [s for s in self._later_known if s not in steps]:
                del self._later_known[s]
            self._unreadable.intersection_update(steps)
            self._manifest_unsure.intersection_update(steps)
        self.keep_files(steps)
        return out


def _identity(root: Path, step: int, storage: ReadStorage) -> object:
    """What tells a step's manifest from one saved again under the same number (None
    where the storage cannot say, or the file is not there)."""
    if not isinstance(storage, LocalStorage):
        return None
    try:
        st = os.stat(root / step_dir_name(step) / MANIFEST_NAME)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# A metrics.json changed this recently (seconds) is read again at every ask: two changes
# within a clock tick (4 ms here; seconds on some network filesystems) may leave it the
# same inode (freed and taken again), size and times (racy-git's rule)
_RECENT_S = 2.0


def _later_identity(root: Path, step: int, storage: ReadStorage) -> object:
    """What tells ``step``'s metrics.json from the one before it (a marker where there is
    none); None where it cannot be told: another storage, a stat that fails, or a file
    changed in the last ``_RECENT_S`` seconds."""
    if not isinstance(storage, LocalStorage):
        return None
    try:
        st = os.stat(root / step_dir_name(step) / LATER_METRICS_NAME)
    except FileNotFoundError:
        return "none"
    except OSError:
        return None
    if time.time() - max(st.st_mtime, st.st_ctime) < _RECENT_S:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class MetricMode:
    """Which way a checkpointer's ``best_metric`` ranks: its ``best_mode`` where given;
    else as the newest step under the root that recorded one says (a run resumed without
    best_mode="max" ranks as it did before), else "min". A save with a given mode the
    steps recorded the other way is refused (its retention would remove the steps ranked
    best so far: a trial); steps that recorded both ways are warned of, once.
    Thread-safe (retention asks on the writer thread)."""

    def __init__(self, metric: str, mode: str | None, cache: StepMetrics) -> None:
        self.metric, self.mode, self.cache = metric, mode, cache
        self._lock = threading.Lock()
        self._told: set[object] = set()  # (what was warned of)
        # what this checkpointer's saves record (None: nothing), once looked up
        self._saving: tuple[str | None] | None = None

    def get(self, root: Path, storage: ReadStorage, steps: Iterable[int]) -> str:
        """The mode to rank ``steps`` (every committed step) by."""
        recorded, found = self._recorded(root, storage, steps, "ranked by")
        if self.mode is None:
            return recorded[0] if recorded is not None else "min"
        if recorded is not None and self.mode not in found and self._once("given"):
            log.warning("%s: %s ranks by the %s value as given", self._against(
                root, recorded), _given(self.mode), MODE_WORDS[self.mode])
        return self.mode

    def for_save(self, root: Path, storage: ReadStorage,
                 steps: Callable[[], Iterable[int]]) -> str | None:
        """The mode a save records: the one given, or else the one the steps recorded
        (None where neither says: "min" by default is no choice, and a reader then
        judges by the metric's name), looked up once, before this checkpointer's first
        save records its own (``steps`` lists the committed ones). Only the newest
        ``_INHERIT_FROM`` steps are looked at: on the save's path, a root of steps that
        recorded none (saved by an earlier library) is not read whole.

        Raises CheckpointConfigError where a mode was given that no step recorded but
        the other way, or none was given where steps recorded both ways (each save,
        until it is mended: either would have retention remove the steps ranked best so
        far by the other way)."""
        with self._lock:
            known = self._saving
        if known is None:
            every = sorted(steps())
            recorded, found = self._recorded(root, storage, every[-_INHERIT_FROM:], None)
            if recorded is None and self.mode is not None and len(every) > _INHERIT_FROM:
                # (a mode given is checked against every step, not only the newest: a
                # review's two "max" steps under eight that recorded none were removed)
                recorded, found = self._recorded(root, storage, every, None)
            if self.mode is not None and recorded is not None and self.mode not in found:
                raise CheckpointConfigError(
                    f"{self._against(root, recorded)}: from this save on, keep_best and "
                    f"best_step() would rank by the {MODE_WORDS[self.mode]} value, and the steps "
                    f"ranked best so far would be removed; pass best_mode={recorded[0]!r} "
                    "(or None: as the steps recorded); to rank it the other way on purpose, "
                    "save into a new directory, or under another metric name; nothing was "
                    "committed")
            if self.mode is None and len(found) > 1:
                # (a QA trial: a step copied in from a "min" run had a "max" run's resume
                # inherit "min", and remove its two best steps)
                raise CheckpointConfigError(
                    f"the steps under {root} recorded both ways of ranking {self.metric!r} "
                    f"({_both(found)}: a step copied in from another run?), and no best_mode "
                    "was given to say which this run ranks by: pass best_mode='min' or "
                    "'max' (and move the steps of the other way out of this directory); "
                    "nothing was committed")
            if self.mode is None and recorded is None and reads_greater_is_better(
                    self.metric) and self._once("name"):
                # (a trial: keep_best=1 of best_metric="val_acc" kept the worst step and
                # removed the best, unwarned, where the CLI's --best warned of the name)
                log.warning(
                    "best_metric=%r ranks by the least value, as for a loss (best_mode "
                    "defaults to 'min', and no step under %s recorded one): keep_best keeps, "
                    "and best_step() returns, the steps of the least %s; pass "
                    "best_mode='max' if the greatest is best", self.metric, root, self.metric)
            known = (self.mode if self.mode is not None
                     else None if recorded is None else recorded[0],)
            with self._lock:
                self._saving = known
        return known[0]

    def saving(self) -> str:
        """The mode this checkpointer ranks its saves by: the one given, else the one its
        saves record (once the first looked it up), else "min"."""
        with self._lock:
            known = self._saving
        return self.mode or (known[0] if known else None) or "min"

    def forget(self) -> None:
        """Look the mode to record up again at the next save (a rollback deleted the
        steps it was inherited from)."""
        with self._lock:
            self._saving = None

    def _recorded(self, root: Path, storage: ReadStorage, steps: Iterable[int],
                  ranking: str | None) -> tuple[tuple[str, int] | None, dict[str, list[int]]]:
        """The newest of ``steps`` that recorded a mode for the metric, and its mode (None
        where none did); and every mode they recorded, with its steps. Steps that recorded
        both ways (a step copied in from another run) are warned of, once, where
        ``ranking`` ("ranked by") says they are ranked."""
        found = self.cache.recorded_modes(root, storage, steps, self.metric)
        if not found:
            return None, found
        newest = max(((m, ss[0]) for m, ss in found.items()), key=lambda ms: ms[1])
        if len(found) > 1 and ranking is not None and self._once(("both", tuple(found))):
            used = self.mode or newest[0]
            log.warning(
                "the steps under %s recorded both ways of ranking %r: %s (a step copied in "
                "from another run? a run saved with another best_mode?): %s %r (the %s "
                "value best%s); keep those of one way in this directory", root, self.metric,
                _both(found), ranking, used, MODE_WORDS[used],
                ", as given" if self.mode else ": the newest step's")
        return newest, found

    def _against(self, root: Path, recorded: tuple[str, int]) -> str:
        return (f"{_given(self.mode)} ranks {self.metric!r} by the "
                f"{MODE_WORDS[self.mode or 'min']} value, but step {recorded[1]} under {root} "
                f"recorded best_mode={recorded[0]!r} (the {MODE_WORDS[recorded[0]]} value best: a "
                "run saved with other settings)")

    def _once(self, what: object) -> bool:
        with self._lock:
            first = what not in self._told
            self._told.add(what)
        return first


# Metric names that read as "greater is better", and as "less is better": a word that
# ends where a word ends (mIoU, valacc, val_acc, accuracy; not "iou" in "previous"); the
# short ones that open other words also where one begins (not "r2" in "layer2", "win" in
# "window", "wer" in "power")
_GREATER_IS_BETTER = re.compile(r"acc|f1|auc|bleu|rouge|precision|recall|score|"
                                r"map(?![a-z])|iou(?![a-z])|top\d|reward|return|"
                                r"(?<![a-z])win(?:s|rate|_rate)?(?![a-z])|"
                                r"(?<![a-z0-9])r2(?![a-z0-9])")
_LESS_IS_BETTER = re.compile(r"loss|err|perplexity|ppl|mse|mae|nll|(?<![a-z])wer(?![a-z])|"
                             r"(?<![a-z])cer(?![a-z])|fid(?![a-z])|dist")


def _words(metric: str) -> str:
    """``metric`` lowercased, its camelCase parts apart (valAcc: val_acc)."""
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", metric).lower()


def reads_greater_is_better(metric: str) -> bool:
    """Whether the name ``metric`` reads as one whose greatest value is best (accuracy,
    F1, reward...) and not also as a loss or an error."""
    names = (_words(metric), metric.lower())  # (mAP: m_ap, and map)
    return any(_GREATER_IS_BETTER.search(n) for n in names) and not reads_less_is_better(
        metric)


def reads_less_is_better(metric: str) -> bool:
    """Whether the name ``metric`` reads as a loss or an error (least is best)."""
    return any(_LESS_IS_BETTER.search(n) for n in (_words(metric), metric.lower()))


def _both(found: Mapping[str, Sequence[int]]) -> str:
    return "; ".join(f"best_mode={m!r} at step{'s' if len(ss) > 1 else ''} "
                     f"{few([str(x) for x in sorted(ss)], 6)}" for m, ss in sorted(found.items()))


def _given(mode: str | None) -> str:
    return f"best_mode={mode!r}"


# Each mode's best value, in words (for messages)
MODE_WORDS = {"min": "least", "max": "greatest"}
_INHERIT_FROM = 8  # the newest steps a save looks at for the mode it inherits


@dataclass(frozen=True)
class KeepBest:
    """Retention's ``keep_best``: the ``count`` best steps by ``metric_mode`` are kept."""

    count: int
    metric_mode: MetricMode
    # the steps the last ranking spared (none yet: [None]), and the best of it but the
    # save's own step (``leave_out``), for retention's warning of many steps removed at
    # once: a best one displaced is no surprise (a trial's evaluator recorded two steps,
    # and a save removing three was told "if a restart changed those settings")
    _last: list[set[int] | None] = field(default_factory=lambda: [None], compare=False)
    _before: list[set[int]] = field(default_factory=lambda: [set()], compare=False)

    @property
    def cache(self) -> StepMetrics:
        return self.metric_mode.cache

    def spared_before(self) -> set[int] | None:
        """The steps the last ranking spared; None before the first one."""
        return self._last[0]

    def best_without_own(self) -> set[int]:
        """The best steps of the last ranking but its ``leave_out``: those best before
        that save (as the settings now rank)."""
        return self._before[0]

    def would_spare(self, root: Path, storage: ReadStorage, steps: Iterable[int],
                    damaged: Collection[int] = ()) -> set[int]:
        """What ``spared`` would spare, remembering nothing (a rank but the coordinator
        asks, to know whether the coordinator may remove steps before a save)."""
        return self._pick(root, storage, steps, damaged)[0]

    def _pick(self, root: Path, storage: ReadStorage, steps: Iterable[int],
              damaged: Collection[int]) -> tuple[set[int], Ranking, dict[int, float],
                                                 set[int]]:
        steps = list(steps)
        mm = self.metric_mode
        ranking = Ranking(mm.metric, mm.get(root, storage, steps))
        scores = self.cache.scores(root, storage, steps, mm.metric)
        unreadable = self.cache.unreadable(steps)
        intact = {s: v for s, v in scores.items() if s not in damaged}
        out = (set(ranking.best(intact, self.count)) | set(ranking.best(scores, self.count))
               | unreadable)
        return out, ranking, scores, unreadable

    def spared(self, root: Path, storage: ReadStorage, steps: Iterable[int],
               damaged: Collection[int] = (), *, leave_out: int | None = None) -> set[int]:
        """The ``count`` best of ``steps`` (every committed step) ranked among the steps
        not ``damaged``: a damaged best one takes no intact step's place. It is spared as
        well while it ranks among the best of all (a mark may be wrong: a passing read
        error), and goes once others rank above it. Remembered (``spared_before``), with
        the best but ``leave_out`` (``best_without_own``), from the same scores."""
        out, ranking, scores, unreadable = self._pick(root, storage, steps, damaged)
        self._last[0] = out
        if leave_out is not None:
            self._before[0] = set(ranking.best(
                {s: v for s, v in scores.items() if s != leave_out}, self.count)) | unreadable
        return out
