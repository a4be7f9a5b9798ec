"""The ``asyncckpt`` command: list, inspect, verify and export checkpoints.

    asyncckpt ls ROOT                 committed steps under a checkpoint root
    asyncckpt clean ROOT [--dry-run]  remove what saves abandoned (under the root's lock)
    asyncckpt inspect CKPT [--step N] tensors of one checkpoint (root -> latest step)
    asyncckpt verify CKPT [--step N]  check every header and checksum
    asyncckpt export CKPT OUT.safetensors [--step N] [--prefix P] [--strip-prefix]
                     [--dtype bf16|fp16|fp32] [--force]
                                      one safetensors file of whole tensors
    asyncckpt serve CKPT [--step N] [--host H] [--port P] [--advertise-host A]
                    [--token-file F] [--timeout S]
                                      serve one checkpoint to peers over HTTP

Every command takes ``--json`` (a command that fails prints ``{"ok": false, "error":
{"type", "message", "exit_code"}}`` then). Exit codes: 0 fine, 1 the checkpoint is
corrupt, 2 usage error or nothing found, 130 interrupted.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import json
import logging
import math
import os
import re
import shlex
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from . import commit
from .best import (
    LATER_METRICS_NAME,
    MODE_WORDS,
    read_later_metrics,
    reads_greater_is_better,
    reads_less_is_better,
)
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointVersionError,
    retold,
)
from .manifest import MANIFEST_NAME, Manifest, is_shard_file_name
from .reader import (
    VerifyReport,
    check_files,
    deleted_while_read,
    read_manifest,
    read_manifest_summary,
    verify_checkpoint,
)
from .storage import DirectoryLock, LocalStorage, ReadStorage, lock_state
from .tree import ARRAY_NODES, dtype_name, iter_array_nodes, join_path

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # as a shell reports a process ended by SIGINT


class _Usage(Exception):
    """A usage problem found after parsing; the message says what to do."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors raise _ParseError (after printing what
    argparse prints) instead of exiting: ``--json`` then gets its error document too.
    Options are never abbreviated: a script's ``--js`` would break the day another
    option starts alike, and an error document is owed only to ``--json`` as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # subcommands' parsers are made alike
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if sys.stderr is not None:  # print_usage(None) prints on stdout
            self.print_usage(sys.stderr)
        _to_stderr(f"{self.prog}: error: {message}")
        raise _ParseError(message)


class _ParseError(Exception):
    """The command line could not be parsed; argparse's message was printed."""


class _LibraryLog(logging.Handler):
    """The library's warnings, printed as the command's own (``asyncckpt: warning: ...``)
    while a command runs; loggers a command reports on by itself are muted."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.muted: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if any(record.name == m or record.name.startswith(m + ".") for m in self.muted):
            return
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in a log call: logging's own report
            self.handleError(record)
            return
        level = "error" if record.levelno >= logging.ERROR else "warning"
        _to_stderr(f"asyncckpt: {level}: {_shown(message)}")


_LOG = _LibraryLog()
_LOG_RETRY = logging.getLogger("asyncckpt.cli")  # (info: a latest step read again)
_T = TypeVar("_T")


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(unix: float) -> str:
    """Local time of ``unix``, or the raw number where no date can show it."""
    try:
        return datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):
        return str(unix)


_iso = commit.iso_time  # ISO 8601 UTC time, or the raw number where no date can show it


def _shown(text: str, backslashes: bool = False) -> str:
    """``text`` with its unprintable characters (a newline, an escape sequence, a
    right-to-left override in a key) written as Python escapes, so a table stays a table
    and a terminal is never driven by a checkpoint's contents. Where it writes escapes
    (or with ``backslashes``: a table some of whose cells hold escapes), its backslashes
    are doubled: a key with a tab and one with a backslash and a t are not shown alike."""
    if text.isprintable() and not (backslashes and "\\" in text):
        return text
    return "".join(c if c.isprintable() and c != "\\" else
                   "\\\\" if c == "\\" else repr(c)[1:-1] for c in text)


_WIDE = 100


def _scalar_text(scalar: dict[str, Any]) -> str:
    """A scalar of inspect's summary, its kind told apart where the text alone would not
    (a trial's "s5=5, i5=5", "sNone=None, none=None"): strings quoted, bytes as b64:...,
    cut past 60 characters."""
    value, kind = scalar["value"], scalar["type"]
    if kind == "str":
        return _clipped(repr(value))
    if kind == "bytes":
        return _clipped(f"b64:{value}")
    return _clipped(str(value))


def _clipped(text: str, most: int = 60) -> str:
    """``text`` cut to about ``most`` characters, saying how many more there are: a
    scalar of 20 MB (a bytes value, a long string) made inspect's summary one 33 MB line
    (--json holds it whole)."""
    if len(text) <= most:
        return text
    return f"{text[:most]}... ({len(text) - most:,} more characters)"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
           ) -> str:
    """Left-aligned columns (right-aligned for the indices in ``right``), two spaces apart.
    A cell wider than ``_WIDE`` is printed whole but sets no column's width: one key of
    5,000 characters pushed every row's next column 5,000 columns right."""
    escaped = not all(str(c).isprintable() for r in rows for c in r)
    rows = [[_shown(str(c), escaped) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows if len(r[i]) <= _WIDE])
              for i, h in enumerate(headers)]

    def fmt(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(headers), *(fmt(r) for r in rows)])


class _OutputError(Exception):
    """Writing the command's own output to stdout failed: a reader that closed the pipe
    (``| head``), a full disk (``> /dev/full``). Raised apart from OSError, which means
    the checkpoint could not be read."""

    def __init__(self, exc: OSError):
        super().__init__(str(exc))
        self.exc = exc


def _out(text: str = "", *, flush: bool = False) -> None:
    """Print a line of the command's output (stdout)."""
    if sys.stdout is None:  # started with it closed (>&-): print() would drop the line
        raise _OutputError(OSError(errno.EBADF, "stdout is closed"))
    try:
        print(text, flush=flush)
    except OSError as exc:
        raise _OutputError(exc) from exc


def _decided(args: argparse.Namespace, code: int) -> int:
    """Record the command's exit code before it prints anything: a pipe closed early
    must not change the verdict (``verify CORRUPT | head`` still exits 1)."""
    args.verdict = code
    return code


def _json_metrics(metrics: dict[str, float]) -> dict[str, float | str]:
    """A step's metrics for --json: strict JSON has no NaN nor infinity (those are
    written as strings, "nan", "inf", "-inf")."""
    return {k: v if math.isfinite(v) else repr(v) for k, v in metrics.items()}


def _metrics_text(metrics: dict[str, float | str]) -> str:
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in metrics.items())


def _print_json(doc: Any, *, one_line: bool = False) -> None:
    """``doc`` on stdout, indented; ``one_line``: on one line (serve prints its address as
    one line, which a script reads first: so is its failure). Flushed: once it is out
    whole, an interrupt ends the command with the code it says (_DOC_OUT)."""
    text = json.dumps(doc) if one_line else json.dumps(doc, indent=2)
    _DOC_OUT[0] = 1
    _out(text, flush=True)
    _DOC_OUT[0] = 2


# How far this command's JSON document is out: 0 not begun, 1 begun, 2 whole. A signal
# once it is whole exits with the code it says, not 130 (a re-check trial's SIGTERM at the
# end of a long document gave a whole "ok": true document, and exit 130); one while it is
# printed adds no second document to the first's half
_DOC_OUT = [0]


def _step_number(text: str) -> int:
    """--step's type: a step number, 0 or more (argparse reports the ValueError)."""
    step = int(text)
    if step < 0:
        raise ValueError(text)
    return step


_step_number.__name__ = "step number (0 or more)"  # (argparse names the type so)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size(text: str) -> int:
    """``5GB`` (10^9, as Hugging Face counts), ``2GiB``, ``500MB`` or bytes -> bytes."""
    t = text.strip().lower().replace("_", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is no size: give e.g. 5GB, 500MB, 2GiB "
                                         "or a number of bytes") from None
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size of at least one byte")
    return int(value)


def _dtype_name(text: str) -> str:
    """--dtype's type: a name export takes (bf16, bfloat16, fp16, half...), in any case,
    as the Python API takes it; returned lowercased (the report prints it)."""
    from .export import DTYPE_ALIASES

    name = text.strip().lower()
    if name not in DTYPE_ALIASES:
        raise ValueError(text)
    return name


_dtype_name.__name__ = "dtype (bf16, fp16, fp32, fp64, fp8_e4m3 or fp8_e5m2)"


def _resolve(ckpt: str, step: int | None, plain_hint: str = "", command: str = ""
             ) -> tuple[Path, LocalStorage]:
    """The step directory named by CKPT (+ --step); raises _Usage or CheckpointNotFoundError
    (``plain_hint``: what to say when CKPT is a plain safetensors file; ``command``: the
    command, for what it takes)."""
    storage = LocalStorage()
    path = Path(ckpt)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        if path.is_file() and is_shard_file_name(path.name) and (
                path.parent / MANIFEST_NAME).is_file():  # (not "a plain safetensors file")
            raise _Usage(f"{path} is a shard file of the checkpoint {path.parent}: pass that "
                         "step directory")
        plain = (f" ({plain_hint})" if plain_hint and path.suffix == ".safetensors"
                 and path.is_file() else "")
        if command == "inspect" and path.name.endswith(".safetensors.index.json") and (
                path.is_file()):
            plain += f" (an index of sharded safetensors files: pass {path.parent}, which holds it)"
        takes = _TAKES.get(command, "a checkpoint root or a step directory")
        raise _Usage(f"{path} {what}: pass {takes}{plain}"
                     f"{commit.foreign_hint(path) if path.is_file() else ''}")
    if step is not None and (path / MANIFEST_NAME).is_file():
        # (before resolve_step_dir, whose error says it in the words of the Python API)
        found: int | None = None
        with contextlib.suppress(CheckpointError):  # a damaged manifest: verify says so
            found = read_manifest(path, storage).step
        if found is not None and found != step:
            raise _Usage(f"{path} is the step directory of step {found}, not {step}: drop --step "
                         "or pass the checkpoint root")
    step_dir, _ = commit.resolve_step_dir(path, step, storage, uncommitted_ok=True)
    if step_dir == path:
        _warn_if_uncommitted(path)
    return step_dir, storage


def _warn_if_uncommitted(step_dir: Path) -> None:
    kind = commit.temp_dir_kind(step_dir.name)
    if kind == "tmp":
        _warn(f"{step_dir} is the temporary directory of a save that did not commit (still "
              "being written, or abandoned by a crash): no load reads it, and it may hold no "
              "step's whole state")
    elif kind == "deleting":
        _warn(f"{step_dir} is a step being removed by retention (or whose removal failed): "
              "no load reads it")


_TAKES = {  # what a command takes, where more than a checkpoint (a CLI trial)
    "inspect": "a checkpoint root, a step directory, a .safetensors file or a directory of "
               "them",
}
_PLAIN_HINTS = {  # what a command given a plain safetensors file is told
    "verify": "a plain safetensors file holds no checksums to verify: 'asyncckpt inspect' "
              "shows its tensors",
}


def _on_latest(args: argparse.Namespace, attempt: Callable[[Path, LocalStorage], _T],
               failed: Callable[[_T], bool] = lambda _: False) -> tuple[Path, _T]:
    """``attempt(step_dir, storage)`` on the step CKPT (and --step) names, and that step's
    directory. Where that is the latest step of a root and a saver's keep_last deleted it
    while it was read (its directory gone, and ``attempt`` raised or its result
    ``failed``), the new latest is read instead, up to LATEST_TRIES times in all, as
    asyncckpt.load does (a trial's 'verify ROOT' beside a trainer exited 2, "deleted
    while it was being read", in 12 runs of 20)."""
    from .loader import LATEST_TRIES

    best = getattr(args, "best", None) is not None  # (with no --step: _check_choice)
    if best:
        args.step = _best_step(args, Path(args.ckpt))  # (a step named: never replaced)
    for left in range(LATEST_TRIES - 1, -1, -1):
        step_dir, storage = _resolve(args.ckpt, args.step, _PLAIN_HINTS.get(args.command, ""),
                                     args.command)
        latest = args.step is None and step_dir != Path(args.ckpt)
        try:
            result = attempt(step_dir, storage)
        except CheckpointCorruptError as exc:
            if not latest or left == 0 or os.path.lexists(step_dir):
                if (best or latest) and not exc.maybe_intact:
                    raise retold(exc, f"{exc}{_instead(args, step_dir, best)}") from exc.__cause__
                raise
        except (CheckpointError, OSError) as exc:
            if latest and left == 0 and not os.path.lexists(step_dir):
                raise _outpaced(step_dir) from exc
            if not latest or left == 0 or os.path.lexists(step_dir):
                raise
        else:
            if failed(result) and not os.path.lexists(step_dir) and (not latest or left == 0):
                # (a step a saver's retention removed as it was read, named by --step or
                # as a directory: a CLI trial's inspect beside a trainer said DAMAGED, "is
                # missing", exit 1, where cli.md says such a step is no step)
                raise _outpaced(step_dir) if latest else deleted_while_read(step_dir)
            if not latest or left == 0 or not failed(result) or os.path.lexists(step_dir):
                return step_dir, result
        _LOG_RETRY.info("%s was deleted (a save's keep_last) while it was read: reading the "
                        "newest step again", step_dir)
    raise AssertionError("unreachable")  # (the last try returns or raises)


def _outpaced(step_dir: Path) -> CheckpointNotFoundError:
    """The error of a read of the latest step that a saver's retention outpaced every
    time (an ops trial's export beside a keep_last=1 trainer, 1 run in 3, was told to
    use a step that is still committed, and to run 'asyncckpt ls', twice)."""
    from .loader import LATEST_TRIES

    return CheckpointNotFoundError(
        f"the latest step under {step_dir.parent} was deleted while it was being read, "
        f"{LATEST_TRIES} times in a row (last {step_dir.name}): a saver's keep_last removes "
        "each step sooner than this reads it. Read it when the trainer is done or saves "
        "less often, or keep more steps there (keep_last=2, keep_every), or copy the "
        "step out first")


def _instead(args: argparse.Namespace, step_dir: Path, best: bool) -> str:
    """For a step chosen by --best or as the latest that is damaged: the step to name
    instead ("" for none), as best_step() would pick it past this one (a deploy trial's
    'export --best' named no other step: a reader beside a trainer cannot mark one)."""
    from .checkpointer import AsyncCheckpointer

    damaged = commit.step_of_dir_name(step_dir.name)
    if damaged is None or step_dir == Path(args.ckpt):  # (a step directory given: its own)
        return ""
    try:
        with AsyncCheckpointer(step_dir.parent, mode="sync") as ckpt:  # (reads only)
            if best:
                ckpt._damaged.add(damaged)
                other = ckpt.best_step(args.best, _asked_mode(args))
            else:  # the one before it, or (none) the newest other one
                steps = [s for s in reversed(ckpt.steps()) if s != damaged]
                other = next((s for s in steps if s < damaged and not ckpt._amiss(s)),
                             next((s for s in steps if not ckpt._amiss(s)), None))
    except Exception:  # (advice inside an error's path: never in place of that error)
        return ""
    chosen = (f"--best {args.best} was step {damaged}; " if best else "" if args.step
              is not None else f"the latest step was step {damaged}; ")
    if other is None:
        return f" ({chosen}no other step to name instead)"
    what = ("the next best" if best else "the step before it" if other < damaged
            else "the latest")
    return (f" ({chosen}{what} is step {other}: pass --step {other}, whose bytes were not "
            "read yet)")


def _n(count: int, noun: str, plural: str | None = None) -> str:
    """``1 tensor``, ``2 tensors`` (``plural`` where it is not ``noun + "s"``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


# --- ls ----------------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise _Usage(f"{root} {what}: pass a checkpoint root directory"
                     f"{commit.foreign_hint(root) if root.is_file() else ''}")
    storage = LocalStorage()
    # (CheckpointPermissionError for a root it may not list, as the other commands say)
    names = commit.list_root(root, storage)
    lock: dict[str, Any] | None = None  # (the lock state of a root)
    if MANIFEST_NAME in names:  # a step directory: list just that one
        _warn_if_uncommitted(root)
        listing = _Listing(root, storage, [root])
        listing.read_all()
        abandoned: list[str] = []
    else:
        _LOG.muted.add("asyncckpt.commit")  # unlistable step dirs get a row of their own
        listing = _Listing(root, storage)
        listing.relist()
        if not listing.dirs and not listing.unlistable:  # not "no committed checkpoints…"
            commit.refuse_a_step_dir_without_manifest(root, names)
        # A step retired (a save's keep_last) while it was read: the listing is old, and
        # lacks the steps committed since (a trial's 'ls --json' beside a trainer with
        # keep_last=1 said an old keep_best step was the latest): list again, a few times.
        for left in range(_RELISTS, -1, -1):
            if not listing.read_all() or left == 0:
                break
            listing.relist()
        abandoned = commit.abandoned_dirs(root, storage)
        lock = _lock_state(Path(os.path.realpath(root)))  # (read: neither taken nor made)
    unlistable, no_manifest = listing.unlistable, listing.no_manifest
    entries = listing.entries + [
        _unreadable_row(commit.step_of_dir_name(name), root / name,
                        f"cannot be listed ({why}): "
                        + ("it may hold a committed step, so which steps are committed is "
                           "unknown; give this user read access to it" if why in _DENIED else
                           "it counts as no committed step (a symbolic link loop? a damaged "
                           "filesystem?)"))
        for name, why in unlistable]
    listed, latest = len(listing.entries), listing.latest
    # a step it cannot read (permissions, a newer format); a directory it cannot list for
    # another reason (a symbolic link loop, EIO) is damage, as verify says of it
    untold = listing.untold or any(why in _DENIED for _, why in unlistable)
    corrupt = listing.corrupt or any(why not in _DENIED for _, why in unlistable)
    entries.sort(key=lambda e: -1 if e["step"] is None else e["step"])
    # A step whose files are amiss, or whose manifest is corrupt, is a corrupt checkpoint:
    # exit 1, as verify would (a script checking ls's status missed it); a step directory
    # without its manifest is a checkpoint lost (or a copy cut short). A directory that
    # cannot be listed (permissions), or a manifest of a newer format, is no damage but
    # a step it cannot tell of: exit 2, as verify would (a health check read 0).
    code = EXIT_CORRUPT if corrupt or no_manifest or any(
        e.get("damaged") for e in entries) else EXIT_USAGE if untold else EXIT_OK
    best: int | None = None  # (--best: marked; none recorded the metric: none marked)
    unranked: list[int] = []  # (--best: steps whose later metrics cannot be read)
    if args.best is not None:  # (a step directory: refused, as by the other commands)
        with contextlib.suppress(CheckpointNotFoundError):
            best = _best_step(args, root, unranked)
        if unranked and code == EXIT_OK:
            code = EXIT_USAGE  # (which step is best, it cannot tell)
    _decided(args, code)
    if args.json:
        # ("without_manifest" as verify --all says it; "no_manifest", its older name)
        _print_json({"root": str(root), "ok": code == EXIT_OK, "steps": entries,
                     "latest": latest, **({"best": best, "unranked": unranked}
                                          if args.best is not None else {}),
                     "incomplete": abandoned, "lock": lock,
                     "without_manifest": no_manifest, "no_manifest": no_manifest})
        return code
    if not entries:
        _out(f"no committed checkpoints under {root}{commit.foreign_hint(root, names)}"
             f"{'' if abandoned else commit.nested_hint(root, names, storage)}")
    else:
        metrics = any(e.get("metrics") for e in entries)  # (a column only where there are)
        rows = [[str(e["step"]), human_bytes(e["bytes"]), str(e["tensors"]),
                 _when(e["created_unix"]),
                 *([_shown(_metrics_text(e["metrics"]))]
                   if metrics else []),
                 ", ".join((["latest"] if e["step"] == latest else [])
                           + ([f"best {_shown(args.best)}"] if e["step"] == best else [])
                         + ([_shown(f"{_n(len(e['extra_files']), 'entry', 'entries')} no "
                                    "save wrote: "
                                    f"{', '.join(e['extra_files'][:3])}"
                                    f"{' and more' if len(e['extra_files']) > 3 else ''}")]
                            if e["extra_files"] else [])
                           + ([_shown(f"DAMAGED: {'; '.join(e['damaged'])} (run 'asyncckpt "
                                      f"verify {root} --step {e['step']}')")]
                              if e["damaged"] else []))]
                if e["error"] is None else
                ["?" if e["step"] is None else str(e["step"]), "?", "?", "?",
                 *(["?"] if metrics else []),
                 f"{'DAMAGED' if e['error'] in e['damaged'] else 'UNREADABLE'}: {e['error']}"
                 + "".join(f"; {d}" for d in e["damaged"] if d != e["error"])]
                for e in entries]
        _out(_table(["STEP", "SIZE", "TENSORS", "CREATED", *(["METRICS"] if metrics else []),
                     ""], rows, right=(0, 1, 2)))
        total = sum(e["bytes"] or 0 for e in entries)
        disk = sum(e.get("disk_bytes") or 0 for e in entries)
        _out(f"{_n(listed, 'committed step')}, "
             f"{human_bytes(total)} in all"
             + (f" ({human_bytes(disk)} in their directories)" if disk and any(
                 e.get("extra_files") or e.get("damaged") for e in entries) else "")
             + (f"; {_n(len(unlistable), 'step directory', 'step directories')} cannot be "
                "listed" if unlistable else ""))
    if unranked:
        _out(_shown(f"--best {args.best}: the later metrics of step"
                    f"{'s' if len(unranked) > 1 else ''} {', '.join(map(str, unranked[:5]))} "
                    f"cannot be read: {'it' if len(unranked) == 1 else 'they'} may hold a "
                    f"better {args.best}, so the step marked best may not be"))
    if args.best is not None and best is None and entries:
        # (a researcher trial's typo, --best val_los, printed the table as if all was well)
        _out(_shown(f"no committed step recorded the metric {args.best!r} (or each that did "
                    "is known damaged): none is marked best"))
    if abandoned:
        _out(f"{_n(len(abandoned), 'incomplete or abandoned temp dir')} (never read; the "
             "next save here removes "
             f"them): {', '.join(abandoned)}")
        if lock is not None:
            _out(_shown(f"  {_lock_line(root, lock)}"))
    if no_manifest:
        _out(_shown(f"{_n(len(no_manifest), 'step directory', 'step directories')} without "
                    f"{MANIFEST_NAME} (checkpoints whose manifest was lost, or a copy cut "
                    f"short: no load reads them): {', '.join(no_manifest)}; 'asyncckpt clean "
                    f"{shlex.quote(str(root))} --without-manifest' removes them"))
    return code


_RELISTS = 3  # ls and verify --all list a root again at most this many times
# Why a step directory could not be listed, where that is a permission (a step that cannot
# be told of, exit 2), not damage
_DENIED = (os.strerror(errno.EACCES), os.strerror(errno.EPERM))


class _Listing:
    """The steps of a root (or the one step directory given) as ``ls`` reads them, their
    rows in ``entries``. ``relist()`` lists the root again (after a step was retired
    while read: the steps committed meanwhile), and ``read_all()`` then reads only the
    steps not read yet. Not thread-safe."""

    def __init__(self, root: Path, storage: LocalStorage, dirs: Sequence[Path] = ()):
        self.root, self.storage = root, storage
        self.dirs = list(dirs)  # to be read by the next read_all()
        self.seen = set(self.dirs)
        self.unlistable: list[tuple[str, str]] = []  # (of the last listing)
        self.no_manifest: list[str] = []  # (of the last listing)
        self.entries: list[dict[str, Any]] = []
        self.latest: int | None = None  # as latest_step() says: unlistable dirs do not count
        self.newest = -1  # the step of latest's directory
        self.corrupt = self.untold = False  # (a step damaged; one it cannot tell of)

    def relist(self) -> None:
        self.unlistable, self.no_manifest = [], []
        steps = commit.committed_steps(self.root, self.storage, self.unlistable,
                                       self.no_manifest)
        self.dirs = [d for d in (self.root / commit.step_dir_name(s) for s in steps)
                     if d not in self.seen]
        self.seen.update(self.dirs)

    def read_all(self) -> bool:
        """Read the steps listed and not read yet; whether one was retired meanwhile."""
        retired = False
        for d in self.dirs:
            row = self._row(d)
            if row is None:
                retired = True  # (retired by retention since it was listed: no step now)
                continue
            self.entries.append(row)
            named = commit.step_of_dir_name(d.name)
            if named is None or named > self.newest:
                self.latest, self.newest = row["step"], -1 if named is None else named
        self.dirs = []
        return retired

    def _row(self, d: Path) -> dict[str, Any] | None:
        """ls's row of the step directory ``d``; None where it went while looked at."""
        try:
            m = read_manifest_summary(d, self.storage)
        except CheckpointError as exc:
            if d != self.root and not os.path.lexists(d):
                return None
            unknown = isinstance(exc, (CheckpointVersionError, CheckpointPermissionError))
            self.corrupt = self.corrupt or not unknown
            self.untold = self.untold or unknown
            # a copied step dir may have any name; a manifest that is damage (not a
            # permission, nor a newer format) is in ``damaged`` too: a script told an exit-1
            # row from an exit-2 one by the text of ``error`` alone (a CLI trial)
            return _unreadable_row(commit.step_of_dir_name(d.name), d, str(exc),
                                   ([] if unknown else [str(exc)]) + _marked(d, self.storage))
        # (one listing feeds both the sizes ls checks and its disk usage: a stat per file)
        disk, extra, listed = _on_disk(d, m.files)
        damaged = _damaged(d, m.files, self.storage, listed)
        if damaged and d != self.root and not os.path.lexists(d):
            return None  # retired while its files were looked at: no step now, no damage
        # (an adversary trial: a shard this user may not read was OK to ls, exit 0, while
        # every load, inspect and verify failed on it; access(): a call per file, as stat)
        denied = [] if damaged else [n for n in m.files if not os.access(d / n, os.R_OK)]
        if denied and d != self.root and not os.path.lexists(d):
            return None  # (retired meanwhile: a CLI trial's ls said "permission denied")
        error = None
        if denied:
            # (its manifest read: what it says is kept, an ops trial's health check lost
            # the age of the latest step to nulls)
            self.untold = True
            error = (f"{', '.join(str(d / n) for n in denied[:3])}"
                     f"{' and more' if len(denied) > 3 else ''} cannot be read by this user "
                     "(permission denied): a load of this step fails; give it read access")
        # (its files and its manifest: a state of 59 MB of scalars showed 4 KiB)
        later, why = _later_metrics(d, self.storage)
        return {"step": m.step, "path": str(d), "bytes": m.total_bytes + m.manifest_bytes,
                "disk_bytes": disk, "extra_files": extra,
                "tensors": m.tensors, "files": len(m.files),
                "created_unix": m.created_unix, "created": _iso(m.created_unix),
                "library_version": m.library_version,
                "metrics": _json_metrics({**later, **m.metrics}),
                "metric_modes": m.metric_modes, "damaged": damaged, "error": error,
                "metrics_error": why}


def _on_disk(step_dir: Path,
             files: Mapping[str, Any]) -> tuple[int | None, list[str], dict[str, int]]:
    """What a step's directory holds on disk: the sizes of all its files (as ``du
    --apparent-size`` counts them: a shard cut short, metrics.json, damaged.json, a file no
    save wrote), and the names of those no save writes there (a core dump, a copy's
    temporary file), which nothing removes but the step's removal. An ops trial's ``ls``
    said 4.2 MB of a shard cut to 1 KB, and a stray 3 MB file was neither counted nor
    told. Third, the sizes of its regular files by name, for ``_damaged``. (None, [], {})
    where the directory cannot be listed."""
    own = {*files, MANIFEST_NAME, LATER_METRICS_NAME, commit.DAMAGED_NAME}
    total, extra, regular = 0, [], {}
    try:
        with os.scandir(step_dir) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # (gone meanwhile)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    regular[e.name] = st.st_size
                elif stat.S_ISDIR(st.st_mode):  # (what it holds, as du counts it: a QA
                    total += _tree_bytes(Path(e.path))  # re-check's 3 MB subdirectory)
                if e.name not in own and not e.name.startswith(f".{LATER_METRICS_NAME}.tmp-"):
                    extra.append(e.name + ("/" if stat.S_ISDIR(st.st_mode) else ""))
    except OSError:
        return None, [], {}
    return total, sorted(extra), regular


def _later_metrics(step_dir: Path, storage: ReadStorage) -> tuple[dict[str, float], str | None]:
    """The metrics recorded for a step after its save (record_metrics), and why they
    cannot be read (None where they can); a file that cannot be read is warned of and
    counts as none (the step's data is not in question)."""
    try:
        return read_later_metrics(step_dir, storage), None
    except (CheckpointError, OSError) as exc:
        why = (str(exc) if isinstance(exc, CheckpointError) else
               f"{step_dir / LATER_METRICS_NAME} cannot be read ({exc}): the metrics "
               "recorded after the save are not shown")
        _warn(why)
        return {}, why


def _unreadable_row(step: int | None, path: Path, error: str,
                    marked: list[str] | None = None) -> dict[str, Any]:
    """ls --json's row of a step whose manifest cannot be read: every key a row has (a
    script reading ``row["bytes"]`` failed on these), its values null but ``error``."""
    return {"step": step, "path": str(path), "bytes": None, "tensors": None, "files": None,
            "disk_bytes": None, "extra_files": [],
            "created_unix": None, "created": None, "library_version": None, "metrics": None,
            "metric_modes": None, "damaged": marked or [], "error": error,
            "metrics_error": None}


def _damaged(step_dir: Path, files: Mapping[str, Any], storage: ReadStorage,
             listed: Mapping[str, int] | None = None) -> list[str]:
    """What ls and inspect say is amiss with a step, a stat per file and no byte read: its
    manifest's ``files`` missing or not of their sizes, and its damaged.json. ``listed``:
    the sizes a listing of the directory just took (see ``commit.files_amiss``)."""
    amiss = commit.files_amiss(step_dir, {n: f.bytes for n, f in files.items()}, listed)
    # a FIFO, device or directory in a file's place is none, as verify says (a trial's ls
    # said "is 0 bytes, not N" of a FIFO, and "4096 bytes" of a directory); looked at only
    # where the sizes disagree (a stat per file is what ls costs, on NFS too)
    odd = [n for n in files if any(a.startswith(f"{n} is ") for a in amiss)
           and _not_regular(step_dir / n)]
    if odd:
        amiss = [a for a in amiss if not any(a.startswith(f"{n} ") for n in odd)] + [
            f"{n} is not a regular file (a FIFO, device or directory)" for n in odd]
    return amiss + _marked(step_dir, storage)


def _not_regular(path: Path) -> bool:
    """Whether ``path`` is there (through links) and is no regular file."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # (missing or unreadable: files_amiss says so)
        return False


def _marked(step_dir: Path, storage: ReadStorage) -> list[str]:
    """What the step's damaged.json says: a fallback load found it damaged. One that cannot
    be read gets verify's advice for it: a crash trial's ls showed a garbage damaged.json
    as a load's verdict, with nothing to do about it."""
    mark = _damaged_mark(step_dir, storage)
    if mark is None:
        return []
    if _unread_mark(mark):
        return [f"{_mark_text(mark)}: if verify finds the step intact, delete "
                f"{step_dir / commit.DAMAGED_NAME}"]
    return [_mark_text(mark)]


def _damaged_mark(step_dir: Path, storage: ReadStorage) -> Mapping[str, object] | None:
    """The step's damaged.json (see commit.read_damaged_mark), or None: there is none, or
    none can be told of."""
    mark = commit.read_damaged_mark(step_dir, storage)
    if mark is not None and _unread_mark(mark):
        # A directory this user may read but not search (mode 0400) answers every read
        # "permission denied": a damaged.json it does not hold is no mark (a trial's ls
        # said "a load found it damaged" of such a step, and exited 1 for it, not 2).
        try:
            there = commit.DAMAGED_NAME in storage.listdir(step_dir)
        except PermissionError:
            there = False  # (whether there is one cannot be told: none is invented)
        except OSError:
            there = True
        if not there:
            return None
    return mark


def _unread_mark(mark: Mapping[str, object]) -> bool:
    """Whether ``mark`` is no mark a load wrote, but read_damaged_mark's word that the
    damaged.json there cannot be read or parsed."""
    return set(mark) == {"problem"}


def _mark_text(mark: Mapping[str, object]) -> str:
    """A damaged.json's verdict, in words; one that cannot be read is said to be so, not
    "a load found it damaged" (which the file, garbage, does not say: a crash trial)."""
    if _unread_mark(mark):
        return (f"its damage mark is unreadable: {mark['problem']}; whether a load found it "
                "damaged is unknown")
    return commit.mark_text(mark)


# --- the directory's lock, and clean -----------------------------------------------------------

def _lock_state(root: Path) -> dict[str, Any]:
    """As storage.lock_state, with the holder's host where its lock file names one."""
    state = lock_state(root)
    state["host"] = DirectoryLock(root).holder_host() if state["pid"] is not None else None
    return state


def _pid_text(pid: int | None, host: str | None = None) -> str:
    # (the host too: on a network filesystem, a pid alone names no process)
    on = f" on host {host}" if host else ""
    return f"pid {pid}{on}" if pid is not None else "a process of unknown pid"


def _lock_line(root: Path, lock: Mapping[str, Any]) -> str:
    """What ls says of the lock beside the temporary directories it lists."""
    if lock["held"]:
        return (f"the lock of {root} is held by {_pid_text(lock['pid'], lock.get('host'))}: "
                "a save may be "
                "writing or removing them right now")
    if lock["held"] is False:
        return (f"no process holds the lock of {root}: they are abandoned; "
                f"'asyncckpt clean {root}' removes them")
    last = (f"; its lock file names {_pid_text(lock['pid'], lock.get('host'))}, the last "
            "process that took it" if lock["pid"] is not None else "")
    return (f"whether a process holds the lock of {root} cannot be told here ({lock['note']}"
            f"{last}): 'asyncckpt clean {root}' removes them unless one does (it takes the "
            "lock, and refuses while another process holds it)")


def _tree_bytes(path: Path) -> int:
    """The sizes of the files under ``path``, summed (a symbolic link counts nothing: its
    removal takes the link alone); what cannot be looked at counts nothing."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    total, todo = 0, [str(path)]
    while todo:
        with contextlib.suppress(OSError), os.scandir(todo.pop()) as entries:
            for e in entries:
                with contextlib.suppress(OSError):
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
    return total


class _Caught(logging.Handler):
    """The warnings logged meanwhile (why cleanup_abandoned could not remove one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.append(record.getMessage())


def cmd_clean(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():  # (not made: clean creates no root)
        what = "is not a directory" if root.exists() else "does not exist"
        raise _Usage(f"{root} {what}: pass a checkpoint root directory"
                     f"{commit.foreign_hint(root) if root.is_file() else ''}")
    real = Path(os.path.realpath(root))  # (as a checkpointer pins it for its lock)
    around = commit.step_dir_around(real)
    if around is not None:
        where = ("is a step directory" if around == real
                 else f"is inside the step directory {around}")
        raise _Usage(f"{root} {where} of a checkpoint: pass the checkpoint root "
                     f"({around.parent}); clean removes what saves left beside the steps")
    storage = LocalStorage()
    lock = DirectoryLock(real, purpose="clean")
    rows: list[dict[str, Any]] = []
    state: dict[str, Any] = {"held": False, "pid": None, "note": None, "host": None}
    def bare() -> list[str]:  # (step directories without their manifest, when asked for)
        return _without_manifest(real, storage, quiet=True) if args.without_manifest else []

    if args.dry_run:  # takes no lock and writes nothing: tells the lock's state, as ls does
        state = _lock_state(real)
        # (held: still listed, exit 2; a CLI trial's dry run listed nothing while a
        # trainer held the lock, where the docs say it lists and tells the holder)
        rows = [_abandoned_row(real, name) for name in commit.abandoned_dirs(real, storage)]
        rows += [_abandoned_row(real, name, bare=True) for name in bare()]
    elif commit.abandoned_dirs(real, storage) or os.path.lexists(lock.path) or bare():
        # (no lock file and nothing to remove: none is made, as in a directory mistyped)
        try:
            taken = lock.acquire()  # as a save takes it (non-blocking)
            # (a load marking a step damaged holds it a moment, and any holder a moment
            # before it writes who it is: an evaluator trial's clean was refused, "held by
            # a process of unknown pid", while a reader marked a step)
            ends = time.monotonic() + 5.0
            while not taken and time.monotonic() < ends and lock.passing() in (
                    "unwritten", "mark"):
                time.sleep(0.01)
                taken = lock.acquire()
        except OSError as exc:
            raise CheckpointPermissionError(
                f"cannot take the lock of {root} ({lock.path}): {exc.strerror or exc}; clean "
                "takes it as a save does, so as to remove nothing a save is writing: nothing "
                "was removed", path=str(lock.path)) from exc
        if not taken:
            named = lock.holder()
            return _refuse_locked(args, root, {"held": True, "note": None,
                                               "pid": int(named) if named.isdecimal() else None,
                                               "host": lock.holder_host()},
                                  "the pid its lock file names")
        try:
            with _sigterm_interrupts():
                rows = [_abandoned_row(real, name)  # (listed again, under the lock)
                        for name in commit.abandoned_dirs(real, storage)]
                rows += [_abandoned_row(real, name, bare=True) for name in bare()]
                for row in rows:
                    _remove(real, row, storage)
        finally:
            lock.release()
    failed = [r for r in rows if r["error"] is not None]
    held = args.dry_run and bool(state["held"])
    code = _decided(args, EXIT_USAGE if failed or held else EXIT_OK)
    freed = sum(r["bytes_freed"] for r in rows)
    # (not asked to remove them: said, as ls says it)
    left = [] if args.without_manifest else _without_manifest(real, storage, quiet=True)
    holder = (f"the lock of {root} is held by {_pid_text(state['pid'], state.get('host'))} "
              "(as /proc/locks shows), a trainer saving there or another clean: clean "
              "would remove nothing now, as these may be a save in progress") if held else None
    if args.json:
        _print_json({"ok": code == EXIT_OK, "root": str(root), "dry_run": args.dry_run,
                     "abandoned": rows, "removed": [r["name"] for r in rows if r["removed"]],
                     "bytes_freed": freed, "lock": state, "without_manifest_left": left,
                     **({"error": {"type": "CheckpointLockedError", "message": holder,
                                   "exit_code": code}} if holder else {})})
        return code
    if holder:
        _error(holder)
    if left:  # (a docs trial: a plain clean said nothing of them)
        _out(_shown(f"{_n(len(left), 'step directory', 'step directories')} without "
                    f"{MANIFEST_NAME} left as they are ({', '.join(left)}): "
                    "--without-manifest removes them"))
    if not rows:
        _out(_shown(f"nothing to remove under {root}: no abandoned temporary directories"
                    + (", no step directory without its manifest" if args.without_manifest
                       else "")))
        return code
    status = {True: "removed", False: "would be removed" if args.dry_run else "NOT REMOVED"}
    _out(_table(["DIRECTORY", "SIZE", ""],
                [[r["name"], human_bytes(r["bytes"]),
                  status[r["removed"]] + (f": {r['error']}" if r["error"] else "")]
                 for r in rows], right=(1,)))
    if args.dry_run:
        _out(_shown(f"{_n(len(rows), 'abandoned directory', 'abandoned directories')}, "
                    f"{human_bytes(sum(r['bytes'] for r in rows))}: none removed (--dry-run)"))
        if state["held"] is None:
            _out(_shown(f"whether a process holds the lock of {root} cannot be told here "
                        f"({state['note']}): clean takes it, and refuses while another "
                        "process holds it"))
        return code
    removed = sum(r["removed"] for r in rows)
    _out(_shown(f"removed {_n(removed, 'abandoned directory', 'abandoned directories')} "
                f"under {root}, {human_bytes(freed)} freed"
                + (f"; {len(failed)} could not be removed" if failed else "")))
    return code


def _abandoned_row(root: Path, name: str, bare: bool = False) -> dict[str, Any]:
    """clean's row of one temporary directory (``bare``: a step directory without its
    manifest), before it is removed."""
    return {"name": name, "path": str(root / name),
            "kind": "without_manifest" if bare else commit.temp_dir_kind(name),
            "bytes": _tree_bytes(root / name), "removed": False, "bytes_freed": 0,
            "error": None}


def _remove(root: Path, row: dict[str, Any], storage: LocalStorage) -> None:
    """Remove one temporary directory, or a step directory without its manifest (first
    renamed out of sight, as retention does: a crash leaves a .deleting- one), under the
    lock, noting in ``row`` what went."""
    caught = _Caught()
    logger = logging.getLogger(commit.__name__)
    logger.addHandler(caught)
    try:
        name = row["name"]
        if row["kind"] == "without_manifest":
            if not commit.still_there(root, name, storage):
                row["removed"] = True  # (gone since it was listed: nothing left to remove)
                return
            if MANIFEST_NAME in storage.listdir(root / name):
                row["error"] = f"it holds {MANIFEST_NAME} now: kept"
                return
            step = commit.step_of_dir_name(name)
            assert step is not None
            name = commit.hide_step(root, step, storage).name
        row["removed"] = bool(commit.cleanup_abandoned(root, storage, [name]))
    except OSError as exc:  # (the rename out of sight failed: it is there as it was)
        row["error"] = f"it could not be removed: {exc.strerror or exc}"
        return
    finally:
        logger.removeHandler(caught)
    if row["removed"]:
        row["bytes_freed"] = row["bytes"]
    else:  # (warned of on stderr already; part of it may be gone)
        row["error"] = "; ".join(caught.messages) or "it could not be removed"
        row["bytes_freed"] = max(0, row["bytes"] - _tree_bytes(root / name))
        if name != row["name"]:  # (the next clean, or save, removes the rest)
            row["error"] += f" (what is left of it is {name})"


def _refuse_locked(args: argparse.Namespace, root: Path, state: dict[str, Any],
                   told: str) -> int:
    """clean's refusal while another process holds the lock: nothing was removed."""
    known = f" ({told})" if state["pid"] is not None else ""
    message = (f"the lock of {root} is held by {_pid_text(state['pid'], state.get('host'))}"
               f"{known}, a trainer "
               "saving there or another clean: nothing was removed, as its temporary "
               "directories may be a save in progress; run clean again once that process "
               "has ended (a checkpointer removes what was abandoned itself when it takes "
               "the lock)")
    _error(message)
    code = _decided(args, EXIT_USAGE)
    if args.json:
        _print_json({"ok": False, "root": str(root),
                     "error": {"type": "CheckpointLockedError", "message": message,
                               "exit_code": code}, "lock": state})
    return code


# --- inspect -----------------------------------------------------------------------------------

def _skeleton_summary(node: dict[str, Any], path: str, out: dict[str, Any]) -> None:
    """Collect stateful objects and scalar leaves of a manifest skeleton."""
    t = node["t"]
    if t == "stateful":
        out["stateful"].append({"path": path, "class": node.get("cls", "?")})
        _skeleton_summary(node["state"], path, out)
    elif t == "dict":
        for k, child in node["items"]:
            _skeleton_summary(child, join_path(path, k), out)
    elif t in ("list", "tuple"):
        for i, child in enumerate(node["items"]):
            _skeleton_summary(child, join_path(path, i), out)
    elif t not in ARRAY_NODES:
        value = node.get("v")
        if t == "float" and isinstance(value, str):  # (kept as its repr: a JSON number here)
            with contextlib.suppress(ValueError):
                number = float(value)
                value = number if math.isfinite(number) else value  # ("nan", "inf" as text)
        out["scalars"].append({"path": path, "type": t, "value": value})


def _inspect_doc(step_dir: Path, m: Manifest) -> dict[str, Any]:
    later = {} if m.from_headers else _later_metrics(step_dir, LocalStorage())[0]
    skel: dict[str, Any] = {"stateful": [], "scalars": []}
    _skeleton_summary(m.skeleton, "", skel)
    paths: dict[str, list[str]] = {}  # storage key -> the paths of the tree that hold it
    for path, node in iter_array_nodes(m.skeleton):
        paths.setdefault(node["key"], []).append(path)
    tied = {key: [p for p in ps if p != key] if key in ps else ps[1:]  # the other paths
            for key, ps in paths.items() if len(ps) > 1}
    tensors = [{"path": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                "bytes": t.nbytes, "kind": t.kind,
                "files": sorted({c.file for c in t.chunks}), "chunks": len(t.chunks),
                "tied": tied.get(key, [])}
               for key, t in m.tensors.items()]
    return {"path": str(step_dir), "format": "asyncckpt", "step": m.step,
            "world_size": m.world_size,
            "library_version": m.library_version, "format_version": m.format_version,
            "created_unix": m.created_unix, "created": _iso(m.created_unix),
            "block_bytes": m.block_bytes, "total_bytes": m.total_bytes,
            "tensor_bytes": sum(t["bytes"] for t in tensors),
            "files": {n: {"bytes": f.bytes, "rank": f.rank} for n, f in m.files.items()},
            "tensors": tensors, "skeleton": skel, "user_metadata": m.user_metadata,
            "metrics": _json_metrics({**later, **m.metrics}),
            "metrics_recorded_later": [k for k in later if k not in m.metrics],
            "metric_modes": m.metric_modes}


def _tensor_table(doc: dict[str, Any]) -> str:
    rows = [[t["path"], t["dtype"], str(t["shape"]), str(t["bytes"]), _files_text(t["files"])]
            for t in doc["tensors"]]
    return (_table(["PATH", "DTYPE", "SHAPE", "BYTES", "FILE"], rows, right=(3,)) if rows
            else "(no tensors)")


def _files_text(files: list[str]) -> str:
    """A tensor's files for the table: a tensor of a job of 512 ranks has 512 of them (all
    are in --json)."""
    if len(files) <= 3:
        return ", ".join(files)
    return f"{files[0]} ... {files[-1]} ({len(files)} files)"


def _plain_files(ckpt: str) -> tuple[Path, list[str]] | None:
    """The directory and files of plain safetensors CKPT names (a .safetensors file, or a
    directory of them that is no asyncckpt checkpoint), else None."""
    from .safetensors_files import files_of

    path = Path(ckpt)
    if path.is_file() and path.name.endswith(".safetensors"):
        return path.parent, [path.name]
    if not path.is_dir() or (path / MANIFEST_NAME).exists():
        return None
    try:
        names = os.listdir(path)
    except OSError:
        return None  # (_resolve says what is wrong with it)
    if any(n.startswith(("step_", ".step_")) or is_shard_file_name(n) for n in names) or not any(
            n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return None
    where, files, _ = files_of(path)
    return where, files


def _inspect_plain(args: argparse.Namespace, where: Path, files: list[str]) -> int:
    """inspect of plain safetensors files: what asyncckpt.load_safetensors would load."""
    from .safetensors_files import describe

    if args.step is not None or getattr(args, "best", None) is not None:
        flag = "--step" if args.step is not None else "--best"  # (--best was ignored: a trial)
        raise _Usage(f"{args.ckpt} holds plain safetensors files, which have no steps: drop "
                     f"{flag}")
    m = describe(where, files)
    doc = _inspect_doc(where, m)
    doc.update(format="safetensors", step=None, world_size=None, library_version=None,
               format_version=None, created_unix=None, created=None, block_bytes=None,
               damaged=None)  # (the same keys as a checkpoint's; null where meaningless)
    doc["path"] = str(args.ckpt)
    doc["files"] = {n: {"bytes": f["bytes"]} for n, f in doc["files"].items()}
    _decided(args, EXIT_OK)
    if args.json:
        _print_json({"ok": True, **doc})
        return EXIT_OK
    _out(_tensor_table(doc))
    _out(f"plain safetensors: {_n(len(doc['tensors']), 'tensor')}  {doc['tensor_bytes']} tensor "
         f"bytes ({human_bytes(doc['total_bytes'])} in {_n(len(files), 'file')}); no "
         "checksums: load them with "
         "asyncckpt.load_safetensors")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    plain = _plain_files(args.ckpt)
    if plain is not None:
        return _inspect_plain(args, *plain)
    def attempt(step_dir: Path, storage: LocalStorage) -> dict[str, Any]:
        m = read_manifest(step_dir, storage)
        doc = _inspect_doc(step_dir, m)
        # what ls checks too (a stat per file): inspect showed a truncated shard's tensors
        # and exited 0, where ls says DAMAGED and exits 1
        doc["damaged"] = _damaged(step_dir, m.files, storage)
        if not doc["damaged"]:
            # and what a load checks of the headers (a few KB a file): a shard whose header
            # lists other tensors than its manifest, under a re-sealed manifest, was shown
            # as sound, where verify and load refuse it
            check_files(step_dir, m, m.files, storage, doc["damaged"])
        return doc

    step_dir, doc = _on_latest(args, attempt, lambda d: bool(d["damaged"]))
    code = _decided(args, EXIT_CORRUPT if doc["damaged"] else EXIT_OK)
    doc = {"ok": code == EXIT_OK, **doc}
    if doc["damaged"]:
        _warn(_shown(f"step {doc['step']} is DAMAGED: {'; '.join(doc['damaged'])}: its "
                     f"tensors are listed from its manifest (run 'asyncckpt verify "
                     f"{step_dir}')"))
    if args.json:
        _print_json(doc)
        return code
    _out(_tensor_table(doc))
    for t in doc["tensors"]:
        for path in t["tied"]:
            _out(f"{_shown(path)}: tied to {_shown(t['path'])} (stored once)")
    skel = doc["skeleton"]
    classes = ", ".join(f"{s['path'] or '<root>'}: {s['class']}" for s in skel["stateful"])
    _out(f"step {doc['step']}  world size {doc['world_size']}  "
         f"{_n(len(doc['tensors']), 'tensor')}  "
         f"{doc['tensor_bytes']} tensor bytes ({human_bytes(doc['total_bytes'])} in "
         f"{_n(len(doc['files']), 'file')})  "
         f"asyncckpt {doc['library_version']}  created {_when(doc['created_unix'])}")
    owned = [s["path"] for s in skel["stateful"]]
    loose = [f"{_clipped(s['path'])}={_scalar_text(s)}" for s in skel["scalars"]
             if not any(o == "" or s["path"] == o or s["path"].startswith(o + "/")
                        for o in owned)]  # ("": a stateful root owns every path)
    shown = ", ".join(loose[:8]) + (f" and {len(loose) - 8} more" if len(loose) > 8 else "")
    if shown and len(loose) < len(skel["scalars"]):  # (the rest are the objects' own)
        shown = f"{len(loose)} outside the objects: {shown}"
    _out(_shown(f"non-tensor state: {len(skel['scalars'])} scalars"
                + (f" ({shown})" if shown else "") + (f"; objects {classes}" if classes else "")))
    if doc["user_metadata"]:
        _out(_shown("metadata: " + ", ".join(f"{k}={v}" for k, v in doc["user_metadata"].items())))
    if doc["metrics"]:
        after = doc["metrics_recorded_later"]
        _out(_shown("metrics: " + _metrics_text(doc["metrics"])
                    + (f" ({', '.join(after)} recorded after the save)" if after else "")))
    if doc["metric_modes"]:
        _out(_shown("ranked by: " + ", ".join(f"{k} ({MODE_WORDS[v]} is best)"
                                             for k, v in doc["metric_modes"].items())))
    _out(f"checkpoint: {step_dir}")
    return code


# --- verify ------------------------------------------------------------------------------------

class _Progress:
    """The progress of long work on one line of stderr, where stderr is a terminal:
    redrawn at most every ``interval_s`` (and at the end), erased by ``end()``."""

    def __init__(self, what: str, *, enabled: bool | None = None, interval_s: float = 0.5):
        self.what = what
        self.enabled = (sys.stderr is not None and sys.stderr.isatty()) if enabled is None \
            else enabled
        self.interval_s = interval_s
        self.t0 = self.last = time.monotonic()
        self.width = 0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval_s and done < total):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        line = (f"{self.what}: {human_bytes(done)} of {human_bytes(total)} "
                f"({100 * done // max(total, 1)}%), {rate / 1e9:.2f} GB/s")
        if done < total and rate > 0:
            line += f", ~{(total - done) / rate:.0f}s left"
        self._draw(line)

    def end(self) -> None:
        if self.width:
            self._draw("")

    def _draw(self, line: str) -> None:
        try:
            sys.stderr.write("\r" + line.ljust(self.width) + ("\r" if not line else ""))
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr went away: the work goes on
            self.enabled = False
        self.width = len(line)


def _verified(step_dir: Path, storage: ReadStorage, threads: int | None = None) -> VerifyReport:
    """verify_checkpoint, its progress shown on stderr as it goes."""
    progress = _Progress(f"verifying {step_dir}")
    try:
        return verify_checkpoint(step_dir, storage, threads=threads, progress=progress)
    finally:
        progress.end()


def cmd_verify(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        raise _Usage(f"--threads {args.threads}: give 1 or more")
    if args.all:
        return _verify_all(args)
    def attempt(step_dir: Path, storage: LocalStorage) -> tuple[VerifyReport, float]:
        t0 = time.perf_counter()
        report = _verified(step_dir, storage, args.threads)
        return report, time.perf_counter() - t0

    storage = LocalStorage()
    try:
        step_dir, (report, seconds) = _on_latest(args, attempt, lambda r: not r[0].ok)
    except commit.StepWithoutManifestError:
        raise
    except CheckpointNotFoundError as exc:
        if args.step is None:
            _refuse_lost_only(Path(args.ckpt), storage, exc)
        raise
    # The latest step of a root: a newer step directory without its manifest is the
    # newest checkpoint lost (a cron job on 'verify ROOT' saw OK and exit 0)
    latest = commit.step_of_dir_name(step_dir.name)  # (the step resolved, readable or not)
    lost = (_without_manifest(step_dir.parent, storage, above=latest)
            if args.step is None and step_dir != Path(args.ckpt) and latest is not None
            else [])
    code = _decided(args, EXIT_OK if report.ok and not lost else EXIT_CORRUPT)
    said = (f"DAMAGED {step_dir.parent}: newer step director"
            f"{'ies' if len(lost) != 1 else 'y'} without {MANIFEST_NAME}: {', '.join(lost)}: "
            "the newest checkpoint lost its manifest (or a copy is cut short); no load reads "
            f"it, and loads take step {latest}:") if lost else ""
    mark = _damaged_mark(step_dir, storage)
    if args.json:
        doc = _verify_doc(step_dir, report, seconds)
        if lost:  # ("newer_without_manifest": its older name)
            doc.update(ok=False, without_manifest=lost, newer_without_manifest=lost)
        if mark is not None:
            doc["damaged_mark"] = mark
        _print_json(doc)
    else:  # (the damage first: a reader of the first line must not see only OK)
        if said:
            _out(said)
        _print_verdict(step_dir, report, seconds)
        if not report.ok:
            _out("load another step, an intact one (asyncckpt ls ROOT lists them)")
        elif mark is not None:  # (ls shows the step DAMAGED: say why, and what to do)
            _out(f"{_mark_text(mark)}; it verifies now: if that was a passing fault, delete "
                 f"{step_dir / commit.DAMAGED_NAME}")
    return code


def _refuse_lost_only(root: Path, storage: LocalStorage, exc: CheckpointNotFoundError) -> None:
    """``verify ROOT`` of a root whose only steps lost their manifests: damage, as ls
    says (exit 1), not "no committed checkpoint" (exit 2, could not tell)."""
    lost: list[str] = []
    committed: list[int] = [0]  # (unknown: as if there were one)
    with contextlib.suppress(OSError, CheckpointError):
        committed = commit.committed_steps(root, storage, [], lost)
    if lost and not committed:
        dirs = _n(len(lost), "step directory", "step directories")
        raise commit.StepWithoutManifestError(
            f"{exc}: {dirs} without {MANIFEST_NAME} ({', '.join(sorted(lost))}: checkpoints whose "
            "manifest was lost, or a copy cut short); no load reads them") from exc


def _without_manifest(root: Path, storage: LocalStorage, above: int | None = None, *,
                      quiet: bool = False) -> list[str]:
    """The step directories under ``root`` (newer than step ``above``: only those are
    looked into, usually none) that lack a manifest; ``quiet``: the commit module's
    warnings muted meanwhile, as ``ls`` mutes them (clean lists the steps only to find
    these: an unlistable step is ls's and verify's to tell of)."""
    names: list[str] = []
    # (afterwards, clean's removals still say what they could not remove)
    with _commit_log_muted() if quiet else contextlib.nullcontext():
        commit.committed_steps(root, storage, [], names, above=above)
    return names


@contextlib.contextmanager
def _commit_log_muted() -> Iterator[None]:
    """The commit module's warnings muted meanwhile, as ``ls`` mutes them for its whole
    run (they tell of step directories the command reports itself)."""
    muting = commit.__name__ not in _LOG.muted
    if muting:
        _LOG.muted.add(commit.__name__)
    try:
        yield
    finally:
        if muting:
            _LOG.muted.discard(commit.__name__)


def _dir_step(step_dir: Path) -> int:
    """The step a step directory's name gives, -1 for none (to sort by)."""
    step = commit.step_of_dir_name(step_dir.name)
    return -1 if step is None else step


def _steps_of(root: Path, storage: LocalStorage
              ) -> tuple[list[int], list[tuple[str, str]], list[str]]:
    """The committed steps under ``root``, its step directories that cannot be listed (name,
    why) and those without a manifest: what verify --all reads and reports (the commit
    module's warning of an unlistable one muted: the report tells of it)."""
    unlistable: list[tuple[str, str]] = []
    lost: list[str] = []
    with _commit_log_muted():
        steps = commit.committed_steps(root, storage, unlistable, lost)
    return steps, unlistable, lost


def _verify_all(args: argparse.Namespace) -> int:
    """``verify ROOT --all``: every committed step, oldest first; exit 1 if any is corrupt
    (the verdicts are printed once all are known: a pipe closed early keeps the code)."""
    if args.step is not None or args.best is not None:
        raise _Usage(f"--all verifies every committed step: drop "
                     f"{'--step' if args.step is not None else '--best'}")
    root = Path(args.ckpt)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise _Usage(f"{root} {what}: --all takes a checkpoint root directory")
    storage = LocalStorage()
    # (CheckpointPermissionError for a root it may not list, as the other commands say)
    if MANIFEST_NAME in commit.list_root(root, storage):
        raise _Usage(f"{root} is one step's directory: --all takes the checkpoint root that "
                     "holds the step_* directories (or drop --all)")
    steps, unlistable, lost = _steps_of(root, storage)
    if not steps and not unlistable:
        names = storage.listdir(root)
        exc = CheckpointNotFoundError(f"no committed checkpoint under {root}"
                                      f"{commit.foreign_hint(root, names)}"
                                      f"{commit.nested_hint(root, names, storage)}")
        _refuse_lost_only(root, storage, exc)
        raise exc
    done: list[tuple[Path, VerifyReport, float]] = []
    # Steps that could not be judged (unreadable for lack of permission, a newer format):
    # the others are still verified (a trial's one unreadable step hid them all).
    untold: dict[Path, str] = {}
    seen: set[int] = set()
    for left in range(_RELISTS, -1, -1):
        retired = False
        for step in steps:
            if step in seen:
                continue
            seen.add(step)
            step_dir = root / commit.step_dir_name(step)
            t0 = time.perf_counter()
            report: VerifyReport | str  # (a verdict, or why none could be reached)
            try:
                report = _verified(step_dir, storage, args.threads)
            except CheckpointCorruptError as exc:  # (its manifest: the step is damaged)
                report = VerifyReport(path=step_dir, step=step, problems=[str(exc)])
            except (CheckpointError, OSError) as exc:
                report = (str(exc) if isinstance(exc, CheckpointError)
                          else f"cannot read {exc.filename or step_dir}: {exc.strerror or exc}")
            if (isinstance(report, str) or not report.ok) and not os.path.lexists(step_dir):
                retired = True  # retired by retention since it was listed: no step now
            elif isinstance(report, str):
                untold[step_dir] = report
            else:
                done.append((step_dir, report, time.perf_counter() - t0))
        # A step retired while read: the listing is old, and lacks the steps committed
        # since (a trial's 'verify --all' beside a trainer with keep_last=1 verified an
        # old keep_best step alone): list again, a few times, as ls does.
        if not retired or left == 0:
            break
        steps, unlistable, lost = _steps_of(root, storage)
    # A step directory it cannot list: for lack of permission, a step it cannot tell of;
    # for another reason (a symbolic link loop, EIO), a damaged one, as verify ROOT and ls
    # say (it said "all intact" beside such a step, and exited 0).
    for name, why in unlistable:
        step_dir = root / name
        if why in _DENIED:
            untold[step_dir] = (f"{step_dir} cannot be listed: {why}; give this user read "
                                "access to it")
        else:
            done.append((step_dir, VerifyReport(
                path=step_dir, step=commit.step_of_dir_name(name),
                problems=[f"{step_dir} cannot be listed ({why}): that step is damaged or "
                          "unreadable"]), 0.0))
    done.sort(key=lambda t: _dir_step(t[0]))
    untold = dict(sorted(untold.items(), key=lambda t: _dir_step(t[0])))
    bad = [d.name for d, r, _ in done if not r.ok]
    code = _decided(args, EXIT_CORRUPT if bad or lost else EXIT_USAGE if untold else EXIT_OK)
    unlisted = {root / name for name, _ in unlistable}  # (what it holds is unknown)
    marks = {d: None if d in unlisted else _damaged_mark(d, storage) for d, _, _ in done}
    if args.json:
        _print_json({"root": str(root), "ok": not bad and not lost and not untold,
                     "steps": [_verify_doc(d, r, t) | ({"damaged_mark": marks[d]} if marks[d]
                                                       else {}) for d, r, t in done],
                     "without_manifest": lost,
                     "not_verified": [{"path": str(d), "step": commit.step_of_dir_name(d.name),
                                       "error": e} for d, e in untold.items()]})
        return code
    for d, r, t in done:
        _print_verdict(d, r, t)
        mark = marks[d]
        if r.ok and mark is not None:  # (ls shows it DAMAGED: say why, and what to do)
            _out(f"  {_mark_text(mark)}; it verifies now: if that was a passing fault, "
                 f"delete {d / commit.DAMAGED_NAME}")
    for d, e in untold.items():
        _out(f"NOT VERIFIED {d}: {_shown(e)}")
    _out(f"{_n(len(done), 'committed step')} verified: " + (
        f"{len(bad)} corrupt ({', '.join(bad)}); load another step" if bad else "all intact")
        + (f"; {len(untold)} could not be verified (exit 2 unless one is corrupt)"
           if untold else ""))
    if lost:
        _out(f"{_n(len(lost), 'step directory', 'step directories')} without {MANIFEST_NAME} "
             f"(checkpoints whose manifest was lost, or a copy cut short): {', '.join(lost)}; "
             "exit 1 for them, as ls")
    return code


def _verify_doc(step_dir: Path, report: VerifyReport, seconds: float) -> dict[str, Any]:
    gbps = report.bytes / seconds / 1e9 if seconds > 0 else 0.0
    step = report.step if report.step is not None else commit.step_of_dir_name(step_dir.name)
    return {"path": str(step_dir), "step": step, "ok": report.ok,
            "tensors": report.tensors, "bytes": report.bytes, "seconds": round(seconds, 6),
            "gbps": round(gbps, 3), "problems": report.problems}


def _print_verdict(step_dir: Path, report: VerifyReport, seconds: float) -> None:
    if report.ok:
        gbps = report.bytes / seconds / 1e9 if seconds > 0 else 0.0
        _out(f"OK {step_dir}: step {report.step}, {_n(report.tensors, 'tensor')}, "
             f"{human_bytes(report.bytes)} ({report.bytes} bytes) checked in {seconds:.3f}s "
             f"({gbps:.2f} GB/s)")
        return
    _out(f"CORRUPT {step_dir}: {_n(len(report.problems), 'problem')} "
         f"({_tensors_checked(report)}):")
    tail = "; load another step"  # (said once, after, with where to find one)
    for p in report.problems:
        _out(f"  - {_shown(p[:-len(tail)] if p.endswith(tail) else p)}")


def _tensors_checked(report: VerifyReport) -> str:
    """What a damaged step's report checked of its tensors, and found intact. A crash
    trial's step whose shard file was missing, or whose manifest was cut short, read "0
    tensors intact" of tensors never read: those are said unchecked, not counted."""
    if report.listed is None:  # (no manifest read: no tensor is known, nor checked)
        return "no tensor checked: none could be read because of the problems below"
    checked = report.listed - report.unchecked
    if report.unchecked == 0:
        return f"{report.tensors} of {_n(report.listed, 'tensor')} intact"
    return (f"{checked} of {_n(report.listed, 'tensor')} checked: {report.tensors} intact; "
            "the rest could not be read because of the problems below")


# --- export ------------------------------------------------------------------------------------

def _overflow_word(dtype: str) -> tuple[str, bool]:
    """What a value beyond the range of ``dtype`` (a --dtype name) becomes in the cast:
    inf, NaN (formats without inf), or its largest value (float8_e4m3fn saturates); and
    whether the format holds infinities."""
    import torch

    from .export import DTYPE_ALIASES

    dt = DTYPE_ALIASES[dtype]
    beyond = torch.tensor([torch.finfo(dt).max], dtype=torch.float64) * 4  # (inf for fp64)
    got = float(beyond.to(dt).double())
    has_inf = math.isinf(float(torch.tensor([math.inf]).to(dt).double()))
    return ("inf" if math.isinf(got) else "NaN" if math.isnan(got) else
            f"its largest value ({got:g})"), has_inf


def cmd_export(args: argparse.Namespace) -> int:
    from .export import ExportReport, export_safetensors

    # Skipped tensors and overflowing casts are reported below; the export's other
    # warnings (a killed export's temporary removed) are printed as they come.
    _LOG.muted.add("asyncckpt.export.report")
    if args.strip_prefix and not args.prefix:
        raise _Usage("--strip-prefix needs --prefix (e.g. --prefix model/)")
    path = Path(args.ckpt)
    progress = _Progress(f"exporting {path}")

    def attempt(step_dir: Path, _: LocalStorage) -> ExportReport:
        return export_safetensors(step_dir, args.out, prefix=args.prefix,
                                  strip_prefix=args.strip_prefix, dtype=args.dtype,
                                  force=args.force, progress=progress,
                                  max_shard_bytes=args.max_shard_size, tied=args.tied)

    try:
        with _sigterm_interrupts():  # so that the half-written output is removed
            _, report = _on_latest(args, attempt)  # (the step: resolved here, said first)
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            if "force=True (--force)" in str(exc):  # (the library's words for both)
                raise retold(exc, str(exc).replace("force=True (--force)", "--force")
                             .replace("(force=True or --force", "(--force")) from None
            raise
        raise _Usage(f"cannot export {path}: {exc.strerror or exc}"
                     f"{f' ({exc.filename})' if exc.filename else ''}") from exc
    finally:
        progress.end()
    _decided(args, EXIT_OK)  # the file is written
    for s in report.skipped:
        _warn(f"skipped {_shown(s.key)} ({s.dtype} {list(s.shape)}): {s.reason}")
    word, inf = _overflow_word(args.dtype) if report.overflowed else ("", True)
    for name, n in report.overflowed.items():
        _warn(f"{_n(n, 'value')} of {_shown(name)} {'are' if n != 1 else 'is'} beyond the "
              f"range of {args.dtype}{'' if inf else ' (or infinite: it has no inf)'} and "
              f"became {word}")
    if args.json:
        _print_json({"ok": True, **report.to_json()})
        return EXIT_OK
    rows = [[t.name, t.dtype if t.dtype == t.source_dtype else f"{t.dtype} (from {t.source_dtype})",
             str(list(t.shape)), str(t.nbytes), "" if t.name == t.key else t.key]
            for t in report.tensors]
    if rows:
        head = ["NAME", "DTYPE", "SHAPE", "BYTES", "FROM"]
        if not any(r[4] for r in rows):  # (no name differs from its key: an empty column)
            head, rows = head[:4], [r[:4] for r in rows]
        _out(_table(head, rows, right=(3,)))
    for alias, name in report.aliases.items():
        _out(f"{_shown(alias)}: tied to {_shown(name)} (written once)")
    gbps = report.tensor_bytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
    if args.max_shard_size is not None:
        _out(f"files: {', '.join(report.files)}")
    _out(f"wrote {report.out_path}: {_n(len(report.tensors), 'tensor')}, "
         f"{human_bytes(report.file_bytes)} ({report.file_bytes} bytes) from step {report.step} "
         f"of {report.step_dir} in {report.seconds:.3f}s ({gbps:.2f} GB/s)"
         + (f"; {len(report.skipped)} skipped" if report.skipped else ""))
    return EXIT_OK


# --- serve -------------------------------------------------------------------------------------

TOKEN_ENV = "ASYNCCKPT_TOKEN"


def _serve_token(args: argparse.Namespace) -> str | None:
    """The shared secret, from --token-file or $ASYNCCKPT_TOKEN (never from argv: ps shows it)."""
    if args.token_file is not None:
        path = Path(args.token_file)
        try:
            token = path.read_text().strip()
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not text"
            raise _Usage(f"cannot read --token-file {path}: {why}") from exc
        if not token:
            raise _Usage(f"--token-file {path} is empty")
        if mode & 0o077:
            _warn(f"{path} can be read by other users; chmod 600 it")
        return token
    env = os.environ.get(TOKEN_ENV)
    if env is None:
        return None
    if not env.strip():
        raise _Usage(f"${TOKEN_ENV} is set but empty")
    return env.strip()


class _StopFlag:
    """Set by the signal handler: a plain attribute. threading.Event.set() takes a lock,
    and a second signal arriving while the first handler held it (GNU timeout sends
    SIGTERM to the child and to its group: two at once) ran the handler again on the
    same thread, which then waited on that lock for ever, deaf to every later signal."""

    requested = False

    def set(self, *_: object) -> None:
        self.requested = True


_SERVE_CHECK_S = 5.0  # serve looks whether its step is still there this often


def _serve_until(stop: _StopFlag, check: Callable[[], None] | None = None) -> None:
    """Serve until Ctrl-C or SIGTERM set ``stop``, calling ``check`` every
    ``_SERVE_CHECK_S`` (tests replace this)."""
    last = time.monotonic()
    while not stop.requested:
        time.sleep(0.2)  # (a signal ends the sleep early only to run its handler)
        if check is not None and time.monotonic() - last >= _SERVE_CHECK_S:
            last = time.monotonic()
            check()


def _served_gone(step_dir: Path, step: int, nbytes: int) -> Callable[[], None]:
    """serve's check of its step: where a saver's retention removed it, warned of once
    (an ops trial: its files, held open, kept their disk space, which neither ls nor du
    showed, unsaid)."""
    told: list[bool] = []

    def identity(st: os.stat_result) -> tuple[int, ...]:
        # (an inode alone is reused once freed, on ext4: review)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    try:
        ident: tuple[int, ...] | None = identity(os.stat(step_dir / MANIFEST_NAME))
    except OSError:
        ident = None

    def check() -> None:
        if told:
            return
        try:
            now = os.stat(step_dir / MANIFEST_NAME)
            anew = ident is not None and identity(now) != ident
        except OSError:
            now, anew = None, False
        if anew:  # (a QA re-check: a rollback, then the step saved anew, went on being
            # served as it was, stale, under its number, unsaid)
            told.append(True)
            _to_stderr(f"asyncckpt: warning: step {step} under {step_dir.parent} was saved "
                       "anew while served (a rollback, then that step again?): this server "
                       "still serves the step as it was when it started; restart it to "
                       "serve the new one", flush=True)
            return
        if now is None:
            told.append(True)
            size = f"{human_bytes(nbytes)} of " if nbytes else ""
            _to_stderr(f"asyncckpt: warning: step {step} was removed from {step_dir.parent} "
                       "while served (a saver's keep_last?): it is still served, from its "
                       f"files held open, whose {size}disk space stays in use (unseen by ls "
                       "and du) until this server stops; restart it to serve the newest "
                       "step", flush=True)
    return check


# HTTPTransport's words for its arguments ("port=0", "host='x'", "own: port=)"): the
# options that give them on the command line
_OPTION_NAMES = re.compile(r"\b(advertise_host|host|port)=(?=(\))?)")


def cmd_serve(args: argparse.Namespace) -> int:

    from .transport.http import MAX_TIMEOUT_S, HTTPTransport

    token = _serve_token(args)
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise _Usage(f"--timeout {args.timeout}: use a positive number of seconds, at most "
                     f"{MAX_TIMEOUT_S:.0f}")
    if not 0 <= args.port <= 65535:
        raise _Usage(f"--port {args.port}: use 0 (any free port) to 65535")
    stop = _StopFlag()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop.set)
    transport = None
    try:
        # (a host or port it cannot listen on: CheckpointConfigError, a usage error)
        try:
            transport = HTTPTransport(timeout=args.timeout, host=args.host, port=args.port,
                                      advertise_host=args.advertise_host, token=token)
        except CheckpointConfigError as exc:  # (its words name keyword arguments)
            said = str(exc).replace("HTTPTransport cannot listen", "cannot listen")
            raise _Usage(_OPTION_NAMES.sub(lambda m: "--" + m[1].replace("_", "-")
                                           + ("" if m[2] else " "), said)) from None
        if token is None and args.host not in ("127.0.0.1", "::1", "localhost"):
            _warn(f"serving on {args.host} without a token: anyone who can reach it can read "
                  f"the checkpoint; set ${TOKEN_ENV} or pass --token-file")
        server = transport

        def attempt(step_dir: Path, storage: LocalStorage) -> VerifyReport | int:
            if args.verify:  # (receivers check every byte anyway: this finds damage first)
                report = _verified(step_dir, storage)
                if not report.ok:
                    return report
            # the files are open once served: a save's keep_last may delete them then
            return server.serve_directory(step_dir)

        step_dir, got = _on_latest(args, attempt, lambda r: isinstance(r, VerifyReport))
        if isinstance(got, VerifyReport):
            _decided(args, EXIT_CORRUPT)
            # (a CLI trial's damaged step 0 was told to "serve an earlier step")
            why = (f"not serving {step_dir}: {_n(len(got.problems), 'problem')} "
                   f"({_tensors_checked(got)})"
                   f"{_instead(args, step_dir, getattr(args, 'best', None) is not None)}")
            _to_stderr(f"asyncckpt: {why}")
            for p in got.problems[:20]:
                _to_stderr(f"  - {_shown(p)}")
            if args.json:  # (as any failure of a --json command: a document on stdout)
                _print_json({"ok": False, "error": {
                    "type": "CheckpointCorruptError", "message": why,
                    "exit_code": EXIT_CORRUPT, "problems": got.problems}}, one_line=True)
            return EXIT_CORRUPT
        address = transport.address()
        _decided(args, EXIT_OK)  # (a reader gone before the address: nobody to serve)
        if args.json:
            _out(json.dumps({"ok": True, "address": address, "step": got, "path": str(step_dir),
                             "token_required": token is not None}), flush=True)
        else:
            _out(address, flush=True)
        _to_stderr(f"asyncckpt: serving step {got} of {step_dir} at {address}"
                   f"{' (token required)' if token else ''}; Ctrl-C or SIGTERM stops",
                   flush=True)
        mark = _damaged_mark(step_dir, LocalStorage())
        if mark is not None:  # (an evaluator trial's clients each failed on it, unwarned)
            _warn(f"step {got} is marked damaged: {_mark_text(mark)}; its receivers will "
                  "likely fail their checks: serve another step (--step), or run 'asyncckpt "
                  "verify' on it (--verify refuses to serve a step that fails)")
        served_bytes = 0
        with contextlib.suppress(OSError):  # (its files' sizes, as du counts them)
            served_bytes = sum(e.stat().st_size for e in os.scandir(step_dir) if e.is_file()
                               and is_shard_file_name(e.name))  # (those it holds open)
        _serve_until(stop, _served_gone(step_dir, got, served_bytes))
    except KeyboardInterrupt:
        pass
    finally:
        if transport is not None:
            transport.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK


# --- entry point -------------------------------------------------------------------------------

def _add_best(sp: argparse.ArgumentParser, text: str = "the committed step of the root "
              "whose METRIC (recorded by save_async(metrics=...)) is best, as "
              "best_step() picks it: ranked as the steps recorded (best_mode), else the "
              "least; --max or --min to choose") -> None:
    sp.add_argument("--best", metavar="METRIC", default=None, help=text)
    sp.add_argument("--max", action="store_true",
                    help="with --best: the greatest value is best (an accuracy); default: "
                    "as the steps recorded it, else the least")
    sp.add_argument("--min", action="store_true",
                    help="with --best: the least value is best (a loss)")


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse an empty path argument: Path("") is the working directory, and a cron job's
    'ls "$UNSET"' exited 0 with no steps (a CLI trial's false green)."""
    for name, metavar in (("dir", "DIR"), ("ckpt", "CKPT"), ("out", "OUT")):
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():  # (blanks too: export wrote " ")
            raise _Usage(f"{metavar} is {'empty' if not value else repr(value)}: pass a path "
                         "(an unset shell variable?); '.' is the working directory")


def _check_choice(args: argparse.Namespace) -> None:
    """The options that choose a step, together: --max only with --best, and --best or
    --step, not both (every command that has them)."""
    best = getattr(args, "best", None)
    for flag in ("max", "min"):
        if getattr(args, flag, False) and best is None:
            raise _Usage(f"--{flag} goes with --best METRIC")
    if getattr(args, "max", False) and getattr(args, "min", False):
        raise _Usage("--max and --min each say which way METRIC ranks: pass one of them")
    if best is not None and getattr(args, "step", None) is not None:
        raise _Usage("--step and --best each name a step: pass one of them")


def _asked_mode(args: argparse.Namespace) -> str | None:
    """The ranking --max or --min asks for; None: as the steps recorded it."""
    return "max" if args.max else "min" if args.min else None


def _best_step(args: argparse.Namespace, root: Path,
               unranked: list[int] | None = None) -> int:
    """The step --best names under ``root`` (AsyncCheckpointer.best_step's choice: steps
    known damaged are passed over); CheckpointNotFoundError when no step recorded it.
    Steps whose later metrics (metrics.json) cannot be read may be the best: they go into
    ``unranked`` where it is given, else a CheckpointError says so (exit 2)."""
    from .checkpointer import AsyncCheckpointer

    if not root.is_dir() or (root / MANIFEST_NAME).exists():
        raise _Usage(f"--best picks among the steps of a checkpoint root: {root} is "
                     f"{'a step directory' if root.is_dir() else 'no directory'}")
    asked = _asked_mode(args)
    with AsyncCheckpointer(root, mode="sync") as ckpt:  # (reads only: takes no lock)
        ckpt._told_foreign = True  # (steps()'s resume warning: no resume here)
        # (every mode recorded: a flag that some step recorded is no flag against them;
        # the newest step's is what best_step() ranks by, as recorded_best_mode says)
        steps = ckpt.steps()
        modes = ckpt._metrics.recorded_modes(ckpt.directory, ckpt.storage, steps, args.best)
        recorded = max(modes, key=lambda m: modes[m][0]) if modes else None
        best = ckpt.best_step(args.best, asked)  # (None: as recorded, else the least)
        # (an ops trial: a step's damaged metrics.json dropped it out of --best unsaid but
        # on stderr; export --best exported another step, exit 0)
        # (not those whose save recorded the metric itself: a later record cannot change
        # it, the review)
        lost = sorted(s for s in ckpt._metrics.unreadable(steps)
                      if args.best not in (ckpt._metrics._saved(root, s, ckpt.storage)[0]
                                           or {}))
        if lost and unranked is not None:
            unranked += lost
        elif lost:
            raise CheckpointError(
                f"--best {args.best}: cannot tell which step is best under {root}: the "
                f"metrics recorded after the save of step{'s' if len(lost) > 1 else ''} "
                f"{', '.join(map(str, lost[:5]))} cannot be read (its "
                f"{LATER_METRICS_NAME}, warned of above), and may hold a better "
                f"{args.best}{'' if best is None else f' than step {best} has'}; record them "
                "again (record_metrics), or remove that file to rank without them, or name "
                "the step with --step")
        value = None
        if best is not None:
            with contextlib.suppress(CheckpointError, OSError):
                value = ckpt.step_metrics(best).get(args.best)
    if value is not None and math.isnan(value):  # (NaN ranks last: so every one is NaN)
        _warn(f"--best {args.best}: step {best} is taken, but its {args.best} is NaN, as is "
              "every step's that recorded it (a diverged run, or a broken evaluation?)")
    elif value is not None and math.isinf(value):
        ranked = asked or recorded or "min"
        if (value < 0) == (ranked == "min"):  # (it ranks first: -inf of a loss)
            _warn(f"--best {args.best}: step {best} is taken, and its {args.best} is "
                  f"{value}, which no finite value outranks (a diverged run, or a broken "
                  "evaluation?): check it before you use it, or name another step with --step")
        else:  # (the worst there is, taken: every step's is so, or NaN)
            _warn(f"--best {args.best}: step {best} is taken, but its {args.best} is "
                  f"{value}, as is (or NaN) every step's that recorded it (a diverged run, "
                  "or a broken evaluation?)")
    if best is not None and asked is not None and recorded is not None and (
            asked not in modes):
        _warn(f"--best {args.best} --{asked} ranks by the {MODE_WORDS[asked]} value (step {best}), "
              f"but the steps recorded best_mode={recorded!r} for it: drop --{asked} to rank "
              "as they did")
    elif best is not None and recorded is None:
        # Steps that recorded no best_mode (saved without best_metric, or by a library
        # before it recorded one: a researcher trial's export --best val_acc, without
        # --max, exported the worst kept step, exit 0): a name that reads the other way
        # than the order asked for is told of
        if not args.max and reads_greater_is_better(args.best):
            _warn(f"--best {args.best} ranks by the least value (step {best}), as for a "
                  "loss (no step recorded a best_mode for it): pass --max if the greatest "
                  "is best")
        elif args.max and reads_less_is_better(args.best):
            _warn(f"--best {args.best} --max ranks by the greatest value (step {best}): drop "
                  "--max if the least is best, as for a loss")
    if best is None:
        raise CheckpointNotFoundError(
            f"no committed step under {root} recorded the metric {args.best!r} (or each that "
            f"did is known damaged): 'asyncckpt ls {root} --json' shows every step's metrics")
    return best


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="asyncckpt",
        description="List, inspect, verify, export and serve asyncckpt checkpoints, and clean "
        "up what saves abandoned.",
        epilog="exit codes: 0 ok, 1 corrupt checkpoint (damaged, or a step directory "
               "without its manifest), 2 could not tell (a usage error, nothing found), "
               "130 interrupted")
    import torch

    from . import __version__
    p.add_argument("--version", action="version",
                   version=f"asyncckpt {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("ls", help="list the committed steps under a checkpoint root")
    ls.add_argument("dir", metavar="DIR", help="checkpoint root directory (or one step's "
                    "directory)")
    _add_best(ls, "mark the committed step whose METRIC (save_async(metrics=...)) is best")
    ls.set_defaults(func=cmd_ls)
    cl = sub.add_parser(
        "clean", help="remove the temporary directories saves abandoned under a root",
        description="Remove the .step_*.tmp-* and .step_*.deleting-* directories under a "
        "checkpoint root: saves that did not commit, and steps whose removal did not end "
        "(a killed run's). Takes the root's lock as a save does, and refuses (exit 2, "
        "removing nothing) while another process holds it: a trainer saving there. Never "
        "touches a committed step.")
    cl.add_argument("dir", metavar="DIR", help="checkpoint root directory")
    cl.add_argument("--dry-run", action="store_true",
                    help="list what would be removed, and remove nothing (takes no lock: "
                    "tells whether one holds it, as ls does)")
    cl.add_argument("--without-manifest", action="store_true",
                    help="also remove the step_* directories without a manifest.json, which "
                    "ls and verify report as damage (a manifest lost, a copy cut short): "
                    "no load reads them")
    cl.set_defaults(func=cmd_clean)
    for name, func, text in (
            ("inspect", cmd_inspect, "show the tensors of one checkpoint (or of plain "
             "safetensors files)"),
            ("verify", cmd_verify, "check every header and checksum of one checkpoint")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("ckpt", metavar="CKPT",
                        help="a checkpoint root (latest step unless --step) or a step directory"
                        + (", or a .safetensors file or a directory of them (Hugging Face "
                           "weights)" if name == "inspect" else ""))
        sp.add_argument("--step", type=_step_number, default=None,
                        help="which committed step of the root")
        _add_best(sp)
        if name == "verify":
            sp.add_argument("--threads", type=int, default=None,
                            help="files or parts of one read at once (default: 2, or 1 "
                            "on one CPU); more can help on a parallel filesystem")
            sp.add_argument("--all", action="store_true",
                            help="verify every committed step of the root, oldest first "
                            "(exit 1 if any is corrupt)")
        sp.set_defaults(func=func)
    ex = sub.add_parser(
        "export", help="write one safetensors file of whole tensors (for Hugging Face etc.)",
        description="Consolidate one checkpoint, however many ranks saved it, into ONE "
        "safetensors file of whole tensors (or, with --max-shard-size, a directory of "
        "them, as the Hub lays out a model), named by their asyncckpt paths (e.g. "
        "model/layers.0.weight). Streams tensor by tensor, verifies every checksum, and "
        "writes to a temporary file renamed into place: a failure leaves no OUT file. "
        "Tensors whose dtype safetensors lacks (e.g. complex128) are skipped with a "
        "warning. Tied tensors are written once.")
    ex.add_argument("ckpt", metavar="CKPT",
                    help="a checkpoint root (latest step unless --step) or a step directory")
    ex.add_argument("out", metavar="OUT", help="the .safetensors file to write (with "
                    "--max-shard-size: the directory)")
    ex.add_argument("--step", type=_step_number, default=None,
                    help="which committed step of the root")
    _add_best(ex)
    ex.add_argument("--prefix", default="",
                    help="export only the tensors under this name (model: model/... and "
                         "model.... but not model_ema/...)")
    ex.add_argument("--strip-prefix", action="store_true",
                    help="remove --prefix from the names (model/w -> w)")
    ex.add_argument("--dtype", type=_dtype_name, default=None,
                    metavar="{bf16,fp16,fp32,fp64,fp8_e4m3,fp8_e5m2}",
                    help="cast floating tensors to this dtype (others are kept as they are); "
                         "also bfloat16, float16, half, float32, float, float64, double, "
                         "float8_e4m3fn, float8_e5m2, in any case")
    ex.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                    help="write OUT as a directory of files of at most SIZE of tensors "
                         "(5GB, 500MB, 2GiB or bytes), with a model.safetensors.index.json, "
                         "as Hugging Face publishes a model")
    ex.add_argument("--tied", choices=("once", "copy"), default="once",
                    help="tied tensors (one storage at several names, such as tied "
                         "embeddings) written once (as Hugging Face does) or under each "
                         "name (for a strict load_state_dict of the tied model)")
    ex.add_argument("--force", action="store_true",
                    help="overwrite OUT if it exists (with --max-shard-size: an earlier "
                         "export's directory only)")
    ex.set_defaults(func=cmd_export)
    sv = sub.add_parser(
        "serve", help="serve one committed checkpoint to peers over HTTP",
        description="Serve one committed checkpoint over HTTP until SIGINT/SIGTERM, for "
        "asyncckpt.load(ADDRESS, token=...) or a recovering worker. Prints the address "
        "(http://HOST:PORT/v1) as the first line of stdout. The token is read from "
        f"--token-file or ${TOKEN_ENV}, never from the command line.")
    sv.add_argument("ckpt", metavar="CKPT",
                    help="a checkpoint root (latest step unless --step) or a step directory")
    sv.add_argument("--step", type=_step_number, default=None,
                    help="which committed step of the root")
    _add_best(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="interface to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    sv.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    sv.add_argument("--advertise-host", default=None,
                    help="host name peers use to reach this one, put in the printed address "
                    "(default: --host, or this machine's host name when --host is 0.0.0.0 or ::)")
    sv.add_argument("--token-file", default=None,
                    help=f"file holding the shared secret (else ${TOKEN_ENV}; none: no check)")
    sv.add_argument("--timeout", type=float, default=60.0,
                    help="seconds an idle connection or a request may wait (default 60)")
    sv.add_argument("--verify", action="store_true",
                    help="check every checksum before serving, and refuse (exit 1) a damaged "
                    "checkpoint; receivers check every byte they fetch either way")
    sv.set_defaults(func=cmd_serve)
    for sp in sub.choices.values():
        sp.add_argument("--json", action="store_true", help="print JSON instead of tables")
        sp.set_defaults(parser=sp)  # (a command's own usage errors name it)
    return p


_SURROGATEESCAPE = codecs.lookup_error("surrogateescape")


def _escape_or_backslash(exc: UnicodeError) -> tuple[str | bytes, int]:
    """surrogateescape where it applies (the bytes of a path), else backslashreplace."""
    try:
        return _SURROGATEESCAPE(exc)
    except UnicodeError:
        return codecs.backslashreplace_errors(exc)


codecs.register_error("asyncckpt.print", _escape_or_backslash)


@contextlib.contextmanager
def _printable_output() -> Iterator[None]:
    """Print what cannot be encoded as backslash escapes rather than fail.

    A saved key or string may hold a lone surrogate (valid in a Python str and in JSON,
    and save keeps it), which no encoding of stdout takes. The streams are set back as
    they were afterwards.
    """
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and errors in ("strict", "surrogateescape"):
            lenient = "backslashreplace" if errors == "strict" else "asyncckpt.print"
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors=lenient)
                changed.append((reconfigure, errors))
    try:
        yield
    finally:
        for reconfigure, errors in changed:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors=errors)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    with _printable_output():
        return _main(argv)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile (its default ends the process without
    running any clean-up)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(
            signal.SIGTERM) in (signal.SIG_IGN, None):
        # (ignored by the caller, `trap '' TERM`: kept so; None: a handler set from C,
        # which signal.signal could not put back)
        yield
        return

    told = [False]

    def interrupt(signum: int, frame: Any) -> None:
        # Once: `timeout` signals the command, then its process group, and the second
        # SIGTERM cut short the clean-up the first had started (a review: a sharded
        # export's temporary directory, with GBs of shards, was left behind)
        if not told[0]:
            told[0] = True
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    _DOC_OUT[0] = 0
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # told by the command's parser: its usage, not the top level's
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except _ParseError as exc:  # printed already; a --json document is still owed
        words = sys.argv[1:] if argv is None else argv
        if "--json" in words:
            with contextlib.suppress(_OutputError):
                _print_json({"ok": False, "error": {"type": "UsageError", "message": str(exc),
                                                    "exit_code": EXIT_USAGE}})
        return EXIT_USAGE
    library = logging.getLogger("asyncckpt")
    library.addHandler(_LOG)
    try:
        _check_paths(args)
        _check_choice(args)
        # SIGTERM (a supervisor's, a timeout's) ends a command as Ctrl-C does: exit 130 and
        # its JSON document (a CLI trial's verify was ended silently, 143, while export
        # said "interrupted"); serve has its own (a clean stop, exit 0)
        with contextlib.nullcontext() if args.func is cmd_serve else _sigterm_interrupts():
            code: int = args.func(args)
        try:  # here, not at exit, where a failure could only be printed as ignored
            if sys.stdout is not None:
                sys.stdout.flush()
        except OSError as exc:
            raise _OutputError(exc) from exc
        return code
    except _Usage as exc:
        return _failed(args, exc, str(exc), EXIT_USAGE)
    except commit.StepWithoutManifestError as exc:  # damage, as ls says of it under its root
        return _failed(args, exc, str(exc), EXIT_CORRUPT)
    except CheckpointNotFoundError as exc:
        told = "'asyncckpt ls " in str(exc) or "; it holds " in str(exc) or (
            "a torch.save file" in str(exc)) or (  # (what to do with another format is said)
            "times in a row" in str(exc)) or (
            "checkpoint root of its own" in str(exc)) or (
            "checkpoint roots of their own" in str(exc))
        hint = "" if told else (
            ": check the path" if ".safetensors" in str(exc)  # (plain files: no steps to list)
            else ": check the path, or run 'asyncckpt ls' on the checkpoint root")
        return _failed(args, exc, f"{exc}{hint}", EXIT_USAGE)
    except CheckpointCorruptError as exc:
        # (verify reads checkpoints: a plain safetensors file it does not take)
        name = Path(str(getattr(exc, "path", None) or "")).name
        plain = name.endswith((".safetensors", ".safetensors.index.json")) and not (
            is_shard_file_name(name))
        hint = "" if args.func is cmd_verify or plain else (
            " (run 'asyncckpt verify' for details)")
        return _failed(args, exc, f"{exc}{hint}", EXIT_CORRUPT)
    except CheckpointError as exc:
        return _failed(args, exc, str(exc), EXIT_USAGE)
    except KeyboardInterrupt as exc:
        decided = getattr(args, "verdict", None)
        if _DOC_OUT[0] == 2 and decided is not None:  # (its document is out whole: it stands)
            return int(decided)
        if _DOC_OUT[0] == 1:  # (cut off: no second document after the first's half)
            _error("interrupted while printing its JSON document: what was printed is "
                   "incomplete")
            return EXIT_INTERRUPTED
        return _failed(args, exc, "interrupted", EXIT_INTERRUPTED)
    except _OutputError as exc:
        _drop_stdout()
        verdict: int | None = getattr(args, "verdict", None)
        if isinstance(exc.exc, BrokenPipeError):  # piped into head: stop quietly
            # the verdict stands; none yet (no command prints before it has one): failed
            return EXIT_USAGE if verdict is None else verdict
        _error(f"could not write the output to stdout: {exc.exc.strerror or exc.exc}; what "
               "was printed is incomplete (the checkpoint was read: this is not its fault)")
        return EXIT_USAGE if verdict in (None, EXIT_OK) else verdict
    except OSError as exc:
        return _failed(args, exc, f"cannot read {exc.filename or 'the checkpoint'}: "
                                  f"{exc.strerror or exc}", EXIT_USAGE)
    except MemoryError as exc:  # (a very large manifest: nothing is said of the data)
        return _failed(args, exc, "out of memory while reading the checkpoint (its manifest "
                                  "or a header is very large): run where more memory is "
                                  "free; this says nothing of whether it is intact",
                       EXIT_USAGE)
    finally:
        library.removeHandler(_LOG)
        _LOG.muted.clear()


def _failed(args: argparse.Namespace, exc: BaseException, message: str, code: int) -> int:
    """Report a command that failed on stderr and, with ``--json``, on stdout as a JSON
    document too (a script parsing stdout gets one either way), unless the command had
    printed its own already (it decides its verdict first: see _decided)."""
    _error(message)
    if getattr(args, "json", False) and getattr(args, "verdict", None) is None:
        with contextlib.suppress(_OutputError):  # stderr has it
            kind = ("UsageError" if isinstance(exc, _Usage) else "Interrupted" if isinstance(
                exc, KeyboardInterrupt) else type(exc).__name__)  # (Ctrl-C, or SIGTERM)
            _print_json({"ok": False, "error": {"type": kind,
                                                "message": message, "exit_code": code}},
                        one_line=getattr(args, "func", None) is cmd_serve)
    return code


def _drop_stdout() -> None:
    """Point stdout at devnull, as Python's documentation advises after EPIPE: its
    buffer is flushed again at exit, which would fail (and print) a second time."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # (no descriptor: a capture)
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def _error(message: str) -> None:
    _to_stderr(f"asyncckpt: error: {message}")


def _warn(message: str) -> None:
    _to_stderr(f"asyncckpt: warning: {message}")


def _to_stderr(text: str, flush: bool = False) -> None:
    """Print on stderr, or nowhere where there is none (a process started with it
    closed): print(file=None) would write on stdout, into a --json document."""
    if sys.stderr is not None:
        print(text, file=sys.stderr, flush=flush)


if __name__ == "__main__":
    sys.exit(main())
