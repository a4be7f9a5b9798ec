"""The public surface of the package: ``__all__`` and the error tree."""

from __future__ import annotations

import inspect
import types

import pytest

import asyncckpt
from asyncckpt import errors


def _own_public_names() -> set[str]:
    """Names in ``asyncckpt``'s namespace that are public and come from asyncckpt itself.

    Submodules, imported stdlib/third-party helpers (``os``, ``Path``, ``Any``,
    ``annotations``) and underscore names are not part of the API.
    """
    names = set()
    for name, obj in vars(asyncckpt).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and (module == "asyncckpt" or module.startswith("asyncckpt.")):
            names.add(name)
    return names


def test_all_has_no_duplicates_and_every_name_exists():
    assert len(asyncckpt.__all__) == len(set(asyncckpt.__all__))
    for name in asyncckpt.__all__:
        assert hasattr(asyncckpt, name), name
        assert not isinstance(getattr(asyncckpt, name), types.ModuleType), name


def test_every_exported_name_is_asyncckpt_code_or_the_version():
    foreign = set(asyncckpt.__all__) - _own_public_names() - {"__version__"}
    assert not foreign, f"__all__ exports names that asyncckpt does not define: {foreign}"
    assert isinstance(asyncckpt.__version__, str) and asyncckpt.__version__


def test_all_equals_the_public_names_defined_by_the_package():
    assert set(asyncckpt.__all__) - {"__version__"} == _own_public_names()


def test_star_import_gives_exactly_all():
    ns: dict[str, object] = {}
    exec("from asyncckpt import *", ns)
    ns.pop("__builtins__")
    assert set(ns) == set(asyncckpt.__all__)


def test_the_documented_entry_points_are_callable():
    for name in ("save", "load", "capture_rng_state", "restore_rng_state"):
        assert inspect.isfunction(getattr(asyncckpt, name)), name
    for name in ("AsyncCheckpointer", "CheckpointerConfig", "RNGState", "CheckpointFuture",
                 "CheckpointInfo"):
        assert inspect.isclass(getattr(asyncckpt, name)), name


@pytest.mark.parametrize(("name", "builtin"), [
    ("CheckpointNotFoundError", FileNotFoundError),
    ("UnsupportedLeafError", TypeError),
    ("CheckpointTimeoutError", TimeoutError),
    ("StateMismatchError", KeyError),
    ("CheckpointCorruptError", ValueError),
    ("CheckpointExistsError", FileExistsError),
    ("CheckpointConfigError", ValueError),
    ("CheckpointInFlightError", RuntimeError),
    ("CheckpointSaveError", RuntimeError),
    ("CheckpointClosedError", RuntimeError),
    ("CheckpointLockedError", RuntimeError),
    ("CheckpointPermissionError", PermissionError),
])
def test_error_derives_from_checkpoint_error_and_its_builtin(name, builtin):
    assert name in asyncckpt.__all__
    cls = getattr(asyncckpt, name)
    assert issubclass(cls, asyncckpt.CheckpointError)
    assert issubclass(cls, builtin)
    # the classes are usable as ordinary exceptions, caught through either base
    args = ("boom",)
    with pytest.raises(asyncckpt.CheckpointError):
        raise cls(*args)
    with pytest.raises(builtin):
        raise cls(*args)


def test_checkpoint_error_is_a_plain_exception():
    assert issubclass(asyncckpt.CheckpointError, Exception)
    assert asyncckpt.CheckpointError is errors.CheckpointError


def test_every_error_class_of_the_package_is_exported():
    defined = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.CheckpointError)}
    assert defined <= set(asyncckpt.__all__)
    for name in defined:
        assert getattr(asyncckpt, name) is getattr(errors, name)


def test_state_mismatch_error_prints_its_message_not_a_repr():
    exc = asyncckpt.StateMismatchError("cannot load: missing a/b", missing=["a/b"])
    assert str(exc) == "cannot load: missing a/b"
    assert exc.missing == ["a/b"] and exc.unexpected == [] and exc.mismatched == []


def test_corrupt_error_carries_path_and_key():
    exc = asyncckpt.CheckpointCorruptError("bad", path="/x/manifest.json", key="w")
    assert exc.path == "/x/manifest.json" and exc.key == "w"
    assert str(exc) == "bad"


def test_add_note_without_add_note_keeps_the_note_in_dunder_notes() -> None:
    """Python 3.10 has no BaseException.add_note: the note goes where 3.11 keeps it."""

    class NoAddNote(Exception):  # an exception as Python 3.10 makes them
        add_note = None

    exc = NoAddNote("boom")
    errors.add_note(exc, "an earlier save failed too")
    errors.add_note(exc, "and another")
    assert exc.__notes__ == ["an earlier save failed too", "and another"]  # type: ignore[attr-defined]
    native = asyncckpt.CheckpointSaveError("boom")
    errors.add_note(native, "noted")
    assert native.__notes__ == ["noted"]  # type: ignore[attr-defined]


def test_advice_added_to_an_error_keeps_what_it_carried() -> None:
    """(review) with_advice, the load's advice put into the message: the fields, the notes
    (a list of its own), the cause, or the context where there was no cause, and the
    traceback without the frame that re-raises it twice."""
    import traceback

    from asyncckpt.errors import with_advice

    def read() -> None:
        try:
            raise OSError(5, "Input/output error")
        except OSError:  # (an implicit context, no cause)
            raise asyncckpt.CheckpointCorruptError(  # noqa: B904
                "step 2 is damaged", path="/ck/f", key="w", maybe_intact=True)

    def load() -> None:
        try:
            read()
        except asyncckpt.CheckpointCorruptError as exc:
            exc.add_note("an earlier note")
            err = with_advice(exc, "load another step")
            raise err from err.__cause__

    with pytest.raises(asyncckpt.CheckpointCorruptError) as info:
        load()
    got = info.value
    assert str(got) == "step 2 is damaged; load another step"
    assert (got.path, got.key, got.maybe_intact) == ("/ck/f", "w", True)
    assert got.__notes__ == ["an earlier note"]
    got.add_note("the caller's")
    assert isinstance(got.__cause__, OSError)  # (the context, kept as the cause)
    frames = [f.name for f in traceback.extract_tb(got.__traceback__)]
    assert frames.count("load") == 1 and frames[-1] == "read", frames
