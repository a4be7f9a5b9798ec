"""Fuzz the manifest parser, the shard-header parser and the loader behind them.

Usage (the scheduled run; also ``main([...])`` from Python)::

    python tests/reliability/fuzz_manifest.py --cases 100000 [--seed N] [--json OUT]
    python tests/reliability/fuzz_manifest.py --atheris [-- libFuzzer options]

The corpus is real checkpoints, saved at start-up into a temporary directory: mixed
dtypes and scalars, numpy leaves, tied and empty tensors, a 2-rank sharded
checkpoint, small checksum blocks, and a peer's partial view. Each case takes one
document, mutates it (byte flips, insertions, deletions, splices, hostile numbers;
or JSON-aware: a node replaced by a hostile value, deleted, duplicated, swapped) and
feeds it to

1. ``manifest.parse_manifest`` (manifest bytes) or ``manifest.decode_header``
   (the first bytes of a shard file);
2. when a mutated manifest parses, or a mutated header belongs to a checkpoint whose
   manifest is intact: ``loader.load_from`` and ``reader.verify_checkpoint`` over an
   in-memory storage that holds the real shard files.

The oracle: only the library's own errors (CheckpointError subclasses); no case runs
longer than ``--case-timeout`` seconds (a hang); every path the loader asks for lies
directly inside the checkpoint directory; and, under an address-space cap of
``--max-memory-mb`` above the start (standalone runs only), no allocation fails —
a failed allocation means a forged size was trusted.

Failures are grouped by signature (exception type and innermost asyncckpt frame).
Signatures listed in ``KNOWN_BUGS`` (reported bugs, see docs/reliability.md) are
counted but only fail the run with ``--strict``. The exit status is 1 when any other
failure was found.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import json
import os
import random
import re
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_DIR = Path("/fuzz/step_000000001")


# --- the corpus: real checkpoints ----------------------------------------------------------------

@dataclass
class Seed:
    """One real checkpoint: its manifest and its shard files (name -> bytes)."""

    name: str
    manifest: bytes
    files: dict[str, bytes]

    def header(self, name: str) -> bytes:
        data = self.files[name]
        n = int.from_bytes(data[:8], "little")
        return data[:8 + n]


def _states() -> dict[str, Any]:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(0)
    tied = torch.randn(8, 8, generator=g)
    return {
        "mixed": {
            "model": {"w": torch.randn(16, 32, generator=g),
                      "h": torch.randn(32, generator=g).to(torch.float16),
                      "b": torch.randn(8, generator=g).to(torch.bfloat16)},
            "ints": {"i8": torch.arange(-5, 5, dtype=torch.int8), "u8": torch.arange(7,
                     dtype=torch.uint8), "i64": torch.arange(12, dtype=torch.int64).view(3, 4),
                     "flag": torch.tensor([True, False])},
            "meta": {"step": 7, "lr": 0.001, "name": "run", "blob": b"\x00\x01pickle?",
                     "none": None, "t": (1, 2.5, "x"), 3: [True, False]},
        },
        "numpy": {"arr": np.arange(10, dtype=np.float32), "sc": np.float64(2.5),
                  "i": np.int32(-3), "empty": torch.empty(0, 4), "zero_d": torch.tensor(3.0),
                  "c64": torch.randn(3, generator=g).to(torch.complex64)},
        "tied": {"enc": {"weight": tied}, "dec": {"weight": tied}, "k": [tied, 1]},
        "blocks": {"big": torch.randn(3 * 4096 + 5, generator=g)},  # many checksum blocks
    }


def build_corpus(workdir: Path) -> list[Seed]:
    """Save the corpus checkpoints under ``workdir`` and read them back as seeds."""
    import asyncckpt
    from asyncckpt.manifest import MANIFEST_NAME
    from asyncckpt.transport.base import serve_state

    try:
        from ._crash_worker import save_two_ranks
    except ImportError:  # run as a script
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _crash_worker import save_two_ranks

    seeds = []
    for name, state in _states().items():
        root = workdir / name
        with asyncckpt.AsyncCheckpointer(root, mode="sync",
                                         block_bytes=4096 if name == "blocks" else 4 << 20) as c:
            c.save(state, 1, metadata={"origin": name})
        seeds.append(_read_seed(name, root / "step_000000001"))
    save_two_ranks(workdir / "two", [1])
    seeds.append(_read_seed("two_ranks", workdir / "two" / "step_000000001"))
    served = serve_state(1, _states()["mixed"], block_bytes=4 << 20, library_version="fuzz")
    files = {n: bytes(src.read(0, src.size)) for n, src in served.files.items()}
    seeds.append(Seed("partial_view", served.manifest(), files))
    for s in seeds:
        assert s.manifest and MANIFEST_NAME not in s.files
    return seeds


def _read_seed(name: str, step_dir: Path) -> Seed:
    from asyncckpt.manifest import MANIFEST_NAME

    files = {p.name: p.read_bytes() for p in step_dir.iterdir() if p.name != MANIFEST_NAME}
    return Seed(name, (step_dir / MANIFEST_NAME).read_bytes(), files)


# --- mutations ----------------------------------------------------------------------

HOSTILE: list[Any] = [
    0, -1, 1, 7, 4095, 4096, 2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
    10 ** 9, 10 ** 30, -10 ** 30, 1.5, -0.0, 1e308, float("inf"), float("-inf"), float("nan"),
    True, False, None, "", ".", "..", "../x", "../../etc/passwd", "/etc/passwd", "a/b", "a\\b",
    "rank_00000.safetensors", "rank_00001.safetensors", "manifest.json", "\x00", "é",
    "x" * 5000, "float32", "bfloat16", "int4", "qint8", "bits8", "torch", "tensor", "dict",
    "F32", "U8", "0" * 16, [], {}, [[[]]], [0], [1, 2], [2 ** 40, 2 ** 40], [10 ** 9],
    {"t": "dict"}, {"t": "tensor", "key": "w"}, {"t": "float", "v": "nan"},
    {"t": "bytes", "v": "!!"}, {"file": "../x"},
    base64.b64encode(b"\x80\x04\x95" + b"\x00" * 8).decode(),  # looks like a pickle
]


def _dumps(v: Any) -> bytes:
    try:
        return json.dumps(v).encode()
    except (ValueError, RecursionError):
        return b"[" * 100_000


def hostile(rng: random.Random) -> Any:
    # A copy: a later mutation of the same document may edit inside the value put there
    # (HOSTILE holds lists and dicts), which must not change HOSTILE for the next case.
    v = copy.deepcopy(rng.choice(HOSTILE))
    if rng.random() < 0.1:  # deep nesting
        depth = rng.choice([50, 250, 450])
        for _ in range(depth):
            v = [v] if rng.random() < 0.5 else {"t": "list", "items": [v]}
    return v


def _nodes(doc: Any, out: list[tuple[Any, Any]], max_depth: int = 64) -> None:
    """(container, key) of every node below ``doc``, down to ``max_depth``."""
    todo = [(doc, 0)]
    while todo:
        node, depth = todo.pop()
        if depth >= max_depth:
            continue
        items = (list(node.items()) if isinstance(node, dict) else
                 list(enumerate(node)) if isinstance(node, list) else [])
        for k, v in items:
            out.append((node, k))
            todo.append((v, depth + 1))


def mutate_json(rng: random.Random, raw: bytes) -> bytes:
    """Change one to three nodes of a JSON document."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return mutate_bytes(rng, raw, [])
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        nodes: list[tuple[Any, Any]] = []
        _nodes(doc, nodes)
        if not nodes:
            break
        parent, key = rng.choice(nodes)
        action = rng.randrange(7)
        if action <= 2:
            parent[key] = hostile(rng)
        elif action == 3:  # delete
            del parent[key]
        elif action == 4 and isinstance(parent, list):  # duplicate
            with contextlib.suppress(ValueError, RecursionError):
                parent.insert(key, json.loads(json.dumps(parent[key])))
        elif action == 4:  # add a key
            parent[rng.choice(["extra", "__proto__", "", "../x", "t", "v"])] = hostile(rng)
        elif action == 5:  # swap with a sibling, or rename a key
            if isinstance(parent, list) and len(parent) > 1:
                j = rng.randrange(len(parent))
                parent[key], parent[j] = parent[j], parent[key]
            elif isinstance(parent, dict):
                new = rng.choice([str(key)[:-1], str(key) + "x", "../" + str(key), "0"])
                parent[new] = parent.pop(key)
        else:  # the same node elsewhere (e.g. one tensor's chunks for another's)
            other_parent, other_key = rng.choice(nodes)
            with contextlib.suppress(KeyError, IndexError, TypeError, ValueError,
                                     RecursionError):
                parent[key] = json.loads(json.dumps(other_parent[other_key]))
    try:
        return json.dumps(doc, separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        return raw


def mutate_bytes(rng: random.Random, data: bytes, others: Sequence[bytes]) -> bytes:
    """Byte-level damage: flips, insertions, deletions, duplications, splices, numbers."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4, 8])):
        action = rng.randrange(8)
        n = len(b)
        if action <= 2 and n:  # flip
            b[rng.randrange(n)] ^= rng.randrange(1, 256)
        elif action == 3:  # insert
            pos = rng.randrange(n + 1)
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        elif action == 4 and n:  # delete a range
            lo = rng.randrange(n)
            del b[lo:lo + rng.randrange(1, 64)]
        elif action == 5 and n:  # duplicate a range
            lo = rng.randrange(n)
            hi = min(n, lo + rng.randrange(1, 256))
            pos = rng.randrange(n + 1)
            b[pos:pos] = b[lo:hi]
        elif action == 6 and others:  # splice with another document
            o = rng.choice(others)
            cut = rng.randrange(min(len(b), len(o)) + 1)
            b = b[:cut] + bytearray(o[cut:])
        else:  # replace a run of digits with a hostile number
            digits = [i for i in range(min(n, 20000)) if 48 <= b[i] <= 57]
            if digits:
                i = rng.choice(digits)
                j = i
                while j < n and 48 <= b[j] <= 57:
                    j += 1
                b[i:j] = str(rng.choice([0, 1, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 40,
                                         4096])).encode()
    return bytes(b)


def mutate_header(rng: random.Random, header: bytes, others: Sequence[bytes]) -> bytes:
    """Damage a safetensors header, often its length prefix."""
    if rng.random() < 0.25:
        n = rng.choice([0, 1, 7, len(header) - 8, len(header), 2 ** 20, 99 << 20, 100 << 20,
                        (100 << 20) + 1, 2 ** 40, 2 ** 63, 2 ** 64 - 1])
        return n.to_bytes(8, "little") + header[8:]
    if rng.random() < 0.4:
        body = mutate_json(rng, header[8:].rstrip(b" "))
        body += b" " * ((-len(body) - 8) % 4096)
        return len(body).to_bytes(8, "little") + body
    return mutate_bytes(rng, header, others)


# --- running one case ---------------------------------------------------------------

class MemoryStorage:
    """ReadStorage over in-memory files; records any path outside the step directory."""

    def __init__(self, files: dict[str, bytes], escapes: list[str]):
        self.files = files
        self.escapes = escapes
        self._names: list[str] = []

    def _name(self, path: Path) -> str:
        if Path(path).parent != STEP_DIR:
            self.escapes.append(str(path))
        return Path(path).name

    def listdir(self, path: Path) -> list[str]:
        return list(self.files) if Path(path) == STEP_DIR else []

    def read_bytes(self, path: Path, limit: int) -> bytes:
        data = self.files.get(self._name(path))
        if data is None:
            raise FileNotFoundError(str(path))
        if len(data) > limit:
            raise ValueError(f"{path} is larger than {limit} bytes")
        return data

    def open_read(self, path: Path) -> int:
        name = self._name(path)
        if name not in self.files:
            raise FileNotFoundError(str(path))
        self._names.append(name)
        return len(self._names) - 1

    def close(self, fd: int) -> None:
        pass

    def file_size(self, fd: int) -> int:
        return len(self.files[self._names[fd]])

    def pread_into(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        data = self.files[self._names[fd]]
        got = 0
        for v in views:
            chunk = data[offset + got:offset + got + len(v)]
            v[:len(chunk)] = chunk
            got += len(chunk)
            if len(chunk) < len(v):
                break
        return got


class Hang(BaseException):
    """Raised by the alarm when one case runs too long."""


@dataclass
class Stats:
    cases: int = 0
    by_target: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1


def _innermost(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "asyncckpt" in f.filename and "tests" not in f.filename]
    f = ours[-1] if ours else (frames[-1] if frames else None)
    return f"{Path(f.filename).name}:{f.name}" if f else "?"


KNOWN_BUGS: dict[str, Callable[[BaseException, str], bool]] = {
    # empty: every signature found so far has been fixed; new ones go here, each with a test
}


def reseal(raw: bytes) -> bytes:
    """A mutated manifest with a valid digest again: without it every mutation would stop
    at the digest check and the parser behind it would never be fuzzed.

    Any bytes at all come out sealed: a document whose digest tail was damaged, or that
    never had one, and does not end with ``}`` gets one (``seal`` hashes its whole input
    but the parser hashes what precedes the tail plus ``}``, so sealing such bytes as
    they are would still fail the digest check)."""
    from asyncckpt.manifest import seal

    m = re.search(rb',"digest":"[^"]*"\}\n?\Z', raw)
    body = raw[:m.start()] + b"}" if m else raw
    return seal(body if body.endswith(b"}") else body + b"}")


DIGEST_REFUSALS = ("the manifest does not end with its digest",
                   "the manifest's digest does not match its contents")


def past_digest(exc: BaseException | None) -> bool:
    """Whether parse_manifest got past its digest check (``exc``: what it raised, if any)."""
    return exc is None or not any(r in str(exc) for r in DIGEST_REFUSALS)


def sealed(doc: dict[str, Any]) -> bytes:
    """A (forged) manifest document as the bytes a writer would store: compact JSON
    closed by a valid digest, any old ``digest`` field dropped. A forged manifest written
    back without it only ever reaches the digest check, never the check it means to test."""
    from asyncckpt.manifest import seal

    body = {k: v for k, v in doc.items() if k != "digest"}
    return seal(json.dumps(body, separators=(",", ":")).encode())


def run_one(stats: Stats, target: str, seed: Seed, data: bytes, header_of: str | None,
            case_timeout: float, resealed: bool = False) -> None:
    """Feed one mutated document; record anything that is not a CheckpointError."""
    from asyncckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointVersionError
    from asyncckpt.loader import load_from
    from asyncckpt.manifest import MANIFEST_NAME, decode_header, parse_manifest
    from asyncckpt.reader import verify_checkpoint

    stats.cases += 1
    stats.by_target[target] = stats.by_target.get(target, 0) + 1
    escapes: list[str] = []
    stage = "parse"
    use_alarm = threading.current_thread() is threading.main_thread()
    if use_alarm:
        signal.setitimer(signal.ITIMER_REAL, case_timeout)
    try:
        if header_of is None:
            if resealed:
                data = reseal(data)
            files = {**seed.files, MANIFEST_NAME: data}
            try:
                parse_manifest(data, "fuzz/manifest.json")
            except (CheckpointCorruptError, CheckpointVersionError) as exc:
                # (any other error, a CheckpointError too, is not what parse_manifest
                # documents: it is recorded as a failure below)
                if past_digest(exc):
                    stats.count("manifest refused")
                elif resealed:
                    _fail(stats, "re-sealed manifest refused by the digest check", exc, seed,
                          target, data)
                else:
                    stats.count("manifest refused by its digest")
                return
            stats.count("manifest parsed")
        else:
            try:
                decode_header(data, "fuzz/header")
            except CheckpointError:
                stats.count("header refused")
            else:
                stats.count("header parsed")
            original = seed.files[header_of]
            n = int.from_bytes(original[:8], "little")
            files = {**seed.files, header_of: data + original[8 + n:],
                     MANIFEST_NAME: seed.manifest}
        storage = MemoryStorage(files, escapes)
        stage = "load"
        try:
            load_from(STEP_DIR, None, storage, threads=1)
            stats.count("loaded")
        except CheckpointError:
            stats.count("load refused")
        stage = "verify"
        with contextlib.suppress(CheckpointError):
            verify_checkpoint(STEP_DIR, storage)
    except Hang as exc:
        _fail(stats, f"hang in {stage}", exc, seed, target, data)
    except Exception as exc:
        where = _innermost(exc)
        known = next((k for k, match in KNOWN_BUGS.items() if match(exc, where)), None)
        sig = f"{type(exc).__name__} at {where} ({stage})"
        _fail(stats, sig, exc, seed, target, data, known)
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
    if escapes:
        _fail(stats, "path outside the step directory", None, seed, target, data,
              extra=escapes[:3])


def _fail(stats: Stats, sig: str, exc: BaseException | None, seed: Seed, target: str,
          data: bytes, known: str | None = None, extra: Any = None) -> None:
    f = stats.failures.setdefault(sig, {"count": 0, "known_bug": known, "seed": seed.name,
                                        "target": target,
                                        "message": (str(exc)[:300] if exc else str(extra)),
                                        "input_b64": base64.b64encode(data[:20000]).decode()})
    f["count"] += 1


# --- driving ------------------------------------------------------------------------

def fuzz(cases: int, seed: int, corpus: list[Seed], *, case_timeout: float = 10.0,
         time_limit: float | None = None, progress: Callable[[Stats], None] | None = None
         ) -> Stats:
    rng = random.Random(seed)
    stats = Stats()
    manifests = [s.manifest for s in corpus]
    headers = [s.header(n) for s in corpus for n in s.files]
    started = time.monotonic()
    old = signal.getsignal(signal.SIGALRM) if threading.current_thread() is \
        threading.main_thread() else None

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang()

    if old is not None:
        signal.signal(signal.SIGALRM, on_alarm)
    try:
        for i in range(cases):
            if time_limit is not None and time.monotonic() - started > time_limit:
                break
            s = rng.choice(corpus)
            pick = rng.random()
            if pick < 0.35:  # half of them re-sealed, to get past the digest
                run_one(stats, "manifest-json", s, mutate_json(rng, s.manifest), None,
                        case_timeout, resealed=i % 2 == 0)
            elif pick < 0.7:
                run_one(stats, "manifest-bytes", s, mutate_bytes(rng, s.manifest, manifests),
                        None, case_timeout, resealed=i % 2 == 0)
            elif pick < 0.75:
                r = rng.random()
                junk = (rng.randbytes(rng.randrange(0, 512)) if r < 0.45 else
                        b"[" * rng.choice([10, 10 ** 5]) if r < 0.55 else
                        _dumps(hostile(rng)))
                run_one(stats, "manifest-random", s, junk, None, case_timeout)
            else:
                name = rng.choice(sorted(s.files))
                run_one(stats, "header", s, mutate_header(rng, s.header(name), headers), name,
                        case_timeout)
            if progress is not None and (i + 1) % 10000 == 0:
                progress(stats)
    finally:
        if old is not None:
            signal.signal(signal.SIGALRM, old)
    return stats


def summary(stats: Stats, seconds: float) -> dict[str, Any]:
    unknown = {k: v for k, v in stats.failures.items() if not v["known_bug"]}
    return {"cases": stats.cases, "seconds": round(seconds, 1), "by_target": stats.by_target,
            "outcomes": stats.outcomes,
            "failures": {k: {kk: vv for kk, vv in v.items() if kk != "input_b64"}
                         for k, v in stats.failures.items()},
            "unknown_failures": len(unknown),
            "known_bug_hits": sum(v["count"] for v in stats.failures.values() if v["known_bug"])}


def cap_memory(mb: int) -> None:
    """Cap the address space at the current size plus ``mb`` MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + (mb << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def run_atheris(corpus: list[Seed], argv: list[str]) -> None:
    """Coverage-guided fuzzing with atheris (libFuzzer). An input is: one byte choosing
    the seed checkpoint and the mode, four bytes seeding the mutators, then the payload
    (a raw manifest, or a raw shard header, in modes 0 and 3). The libFuzzer corpus
    starts from the real manifests and headers; libFuzzer options pass through."""
    import atheris

    k = len(corpus)

    def test_one_input(data: bytes) -> None:
        if len(data) < 5:
            return
        s = corpus[data[0] % k]
        mode = (data[0] // k) % 4
        rng = random.Random(int.from_bytes(data[1:5], "little"))
        rest = data[5:]
        stats = Stats()
        if mode == 0:  # the payload is the manifest
            run_one(stats, "manifest-raw", s, rest, None, 10.0)
        elif mode == 1:
            run_one(stats, "manifest-bytes", s, mutate_bytes(rng, s.manifest, [rest]), None,
                    10.0)
        elif mode == 2:
            run_one(stats, "manifest-json", s, mutate_json(rng, s.manifest), None, 10.0)
        else:  # the payload is the first shard file's header
            run_one(stats, "header", s, rest, sorted(s.files)[0], 10.0)
        for sig, f in stats.failures.items():
            if not f["known_bug"]:
                raise AssertionError(f"{sig}: {f['message']}")

    seeds_dir = Path(tempfile.mkdtemp(prefix="ackfuzz-corpus-"))
    for i, s in enumerate(corpus):
        (seeds_dir / f"manifest_{i}").write_bytes(bytes([i]) + bytes(4) + s.manifest)
        header = s.header(sorted(s.files)[0])
        (seeds_dir / f"header_{i}").write_bytes(bytes([i + 3 * k]) + bytes(4) + header)
    args = list(argv)
    if not any(a.startswith("-max_len") for a in args):
        args.append("-max_len=131072")
    if not any(not a.startswith("-") for a in args):
        args.append(str(seeds_dir))
    atheris.instrument_all()
    atheris.Setup([sys.argv[0], *args], test_one_input)
    atheris.Fuzz()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=None, help="random by default (printed)")
    p.add_argument("--time-limit", type=float, default=None, help="stop after this many s")
    p.add_argument("--case-timeout", type=float, default=10.0)
    p.add_argument("--max-memory-mb", type=int, default=1024,
                   help="address-space headroom over the start (0: no cap); standalone only")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--crash-dir", default=None, help="write failing inputs here")
    p.add_argument("--strict", action="store_true", help="known bugs fail the run too")
    p.add_argument("--atheris", action="store_true", help="coverage-guided, with atheris")
    p.add_argument("--quiet", action="store_true")
    args, rest = p.parse_known_args(argv)
    if rest and not args.atheris:  # (the rest is for libFuzzer, with --atheris)
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if __name__ == "__main__":  # a process of its own: keep torch off the other cores
        import torch

        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ackfuzz-") as tmp:
        corpus = build_corpus(Path(tmp))
    if args.atheris:
        run_atheris(corpus, rest)
        return 0
    seed = args.seed if args.seed is not None else random.randrange(2 ** 32)
    print(f"fuzz seed {seed} (replay with --seed {seed})", file=sys.stderr, flush=True)
    if args.max_memory_mb and __name__ == "__main__":
        cap_memory(args.max_memory_mb)
    t0 = time.monotonic()

    def progress(stats: Stats) -> None:
        if not args.quiet:
            print(f"  {stats.cases} cases, {time.monotonic() - t0:.0f}s, "
                  f"{sum(f['count'] for f in stats.failures.values())} failures", flush=True)

    stats = fuzz(args.cases, seed, corpus, case_timeout=args.case_timeout,
                 time_limit=args.time_limit, progress=progress)
    doc = {"seed": seed, **summary(stats, time.monotonic() - t0)}
    if args.crash_dir:
        out = Path(args.crash_dir)
        out.mkdir(parents=True, exist_ok=True)
        for i, (sig, f) in enumerate(stats.failures.items()):
            (out / f"failure_{i}.bin").write_bytes(base64.b64decode(f["input_b64"]))
            (out / f"failure_{i}.txt").write_text(f"{sig}\n{json.dumps(f, indent=1)}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    report = os.environ.get("ASYNCCKPT_RELIABILITY_REPORT")
    if report and __name__ == "__main__":  # the scheduled run: merge into the figures file
        rp = Path(report)
        figs = json.loads(rp.read_text()) if rp.exists() else {}
        figs["fuzz_scheduled"] = {
            "cases": doc["cases"], "seconds": doc["seconds"], "seed": seed,
            "unknown_failures": doc["unknown_failures"],
            "known_bug_hits": {k: v["count"] for k, v in doc["failures"].items()
                               if v["known_bug"]},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        rp.write_text(json.dumps(figs, indent=2, sort_keys=True) + "\n")
    if not args.quiet:
        print(json.dumps(doc, indent=2))
    bad = doc["unknown_failures"] or (args.strict and stats.failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
