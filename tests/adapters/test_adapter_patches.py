"""`engine_adapters._common.Patches`: two instrumentations of one object, removed in the
wrong order, must not leave wrappers behind silently."""

from __future__ import annotations

import pytest

from engine_adapters._common import Patches, installed_patches, is_patched


class Engine:
    def step(self) -> str:
        return "step"


def _tag(tag: str):
    def make(original):
        def wrapper():
            return f"{tag}({original()})"

        return wrapper

    return make


def test_lifo_restores_everything():
    e = Engine()
    before = installed_patches()
    a, b = Patches(), Patches()
    a.wrap(e, "step", _tag("a"))
    b.wrap(e, "step", _tag("b"))
    assert e.step() == "b(a(step))"
    b.restore()
    assert e.step() == "a(step)"
    a.restore()
    assert e.step() == "step" and not is_patched(e.step)
    assert "step" not in vars(e)
    assert installed_patches() == before


def test_non_lifo_refuses_loudly_and_changes_nothing():
    e = Engine()
    a, b = Patches(), Patches()
    a.wrap(e, "step", _tag("a"))
    b.wrap(e, "step", _tag("b"))
    with pytest.raises(RuntimeError, match="last in, first out"):
        a.restore()  # a's wrapper is under b's: restoring a would drop b's and keep a's
    assert e.step() == "b(a(step))"  # untouched
    b.restore()
    a.restore()  # now in order: everything restored
    assert e.step() == "step" and "step" not in vars(e)


def test_class_level_patch_on_top_of_another_refuses_too():
    class Core:
        def step(self) -> str:
            return "s"

    a, b = Patches(), Patches()
    a.wrap(Core, "step", lambda orig: lambda self: "a" + orig(self))
    b.wrap(Core, "step", lambda orig: lambda self: "b" + orig(self))
    with pytest.raises(RuntimeError):
        a.restore()
    b.restore()
    a.restore()
    assert Core().step() == "s"
