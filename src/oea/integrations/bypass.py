"""Substituted routers: does the class an engine routes a MoE layer with still go through OEA's hook?

A platform may put its own router class in place of the engine's (vLLM's RFC #51005 ``FusedMoERoutingBackend``,
out-of-tree platform plugins; SGLang's out-of-tree ``BaseFusedOp`` forwards). A subclass that overrides the method
OEA's hook sits in (or behind) routes without it and raises nothing: OEA reports itself on and never runs, the
reference deployment's failure. The rule, engine-free: every class derived from a hooked class must resolve each
hooked method, through its MRO, to the very function the hooked class has; and where the plugin installed its
wrapper there, that function must still be the wrapper (``runtime.WRAPPED``; a ``functools.wraps`` of it keeps
the mark, a replacement does not). An override that calls ``super()`` would route through the hook, but reading
code for that is guesswork, so any override fails the check, naming the class and what to do.

Each adapter only supplies its hooked (class, methods) pairs and calls ``find_bypasses`` from its doctor check
(``doctor_check``) and at start-up (``startup_warning``: one warning per substituted class, never raising).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oea.integrations.doctor.common import Check, check
from oea.integrations.runtime import WRAPPED

CHECK_NAME = "router bypass"  # the doctor check's name (contract: contains "bypass")
WARN_KEY = "router-bypass"  # WarnOnce keys: f"{WARN_KEY}:{class}.{method}", one warning per substituted class


@dataclass(frozen=True)
class Bypass:
    """One router class that routes without OEA's hook.

    Attributes:
        router: the class the engine may route with (``module.QualName``).
        method: the method through which OEA's hook runs.
        found: what ``router``'s ``method`` is instead (an override in a class, a replaced function).
        hook: the path through OEA's hook (``module.Class.method``).
    """

    router: str
    method: str
    found: str
    hook: str

    @property
    def key(self) -> str:
        """The WarnOnce key: one warning per class and method in a process."""
        return f"{WARN_KEY}:{self.router}.{self.method}"

    @property
    def message(self) -> str:
        """The one line said at start-up and in the doctor (the words live here only)."""
        return (f"router class {self.router} bypasses OEA: its {self.method} is {self.found}, not {self.hook} (the "
                f"path through OEA's hook), so the MoE layers it routes keep its own routing while OEA reports itself "
                f"on; have its {self.method} call the base's (super().{self.method}), or serve without that router "
                f"substitution")


def class_path(cls: type) -> str:
    """``module.QualName`` of a class, as the messages name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def subclasses(cls: type) -> list[type]:
    """Every class derived from ``cls`` in this process, at any depth, each once, in discovery order."""
    found: list[type] = []
    pending = list(cls.__subclasses__())
    while pending:
        sub = pending.pop(0)
        if sub not in found:  # a diamond reaches a class twice
            found.append(sub)
            pending.extend(sub.__subclasses__())
    return found


def method_owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO whose own ``__dict__`` defines ``name`` (what ``cls().name`` calls), or None."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def is_hook(function: Any) -> bool:
    """Whether ``function`` is a wrapper this project installed (or a ``functools.wraps`` copy of one)."""
    return bool(getattr(function, WRAPPED, False))


def find_bypasses(hooked: type, methods: Sequence[str], wrapped: bool = False) -> list[Bypass]:
    """The classes among ``hooked`` and its subclasses whose ``methods`` do not resolve to ``hooked``'s own.

    ``wrapped``: the plugin installed its wrapper on ``hooked``'s methods in this process, so ``hooked``'s own
    function must still be that wrapper (another plugin may have replaced it afterwards).
    """
    bypasses = []
    for method in methods:
        expected = method_owner(hooked, method)
        if expected is None:  # the engine lacks the method: the hook-target checks report that
            continue
        hook = f"{class_path(expected)}.{method}"
        function = vars(expected)[method]
        if wrapped and not is_hook(function):
            found = getattr(function, "__qualname__", repr(function))
            bypasses.append(Bypass(class_path(hooked), method, f"{found} (replaced after OEA wrapped it)", hook))
        for sub in subclasses(hooked):
            owner = method_owner(sub, method)
            if owner is not expected and owner is not None:
                where = "its own override" if owner is sub else f"the override in {class_path(owner)}"
                bypasses.append(Bypass(class_path(sub), method, where, hook))
    return bypasses


def describe(hooked: Iterable[type]) -> str:
    """What was looked at: each hooked class with the number of its subclasses in this process."""
    return ", ".join(f"{cls.__qualname__} (+{len(subclasses(cls))} subclasses)" for cls in hooked)


def doctor_check(find: Callable[[], tuple[list[Bypass], str]]) -> Check:
    """The doctor's ``router bypass`` check: ``find()`` returns the bypasses and what it looked at (the classes
    walked, after which plugin loading). Failed, naming every class, when one bypasses; failed with the reason when
    ``find`` raises (a check that could not look is no pass)."""
    try:
        bypasses, looked_at = find()
    except Exception as err:
        return check(CHECK_NAME, False, f"could not check the router classes: {type(err).__name__}: {err}")
    if bypasses:
        return check(CHECK_NAME, False, "; ".join(b.message for b in bypasses))
    return check(CHECK_NAME, True, f"every router class routes through OEA's hook: {looked_at}")


def find_safely(find: Callable[[], tuple[list[Bypass], str]], warn: Callable[[str, str], object]) -> list[Bypass]:
    """``find()``'s bypasses; none, after one ``warn``, when it raises: an engine hook never takes a server down,
    and a check that could not look says so instead of passing silently."""
    try:
        return find()[0]
    except Exception as err:
        warn(f"{WARN_KEY}:unchecked", f"could not check the router classes for a substituted router that bypasses "
                                      f"OEA ({type(err).__name__}: {err}); run `oea doctor` in this environment")
        return []


def startup_warning(find: Callable[[], tuple[list[Bypass], str]], warn: Callable[[str, str], object]) -> list[Bypass]:
    """At plugin start-up: one ``warn(key, message)`` per bypassing class (``warn`` is the adapter's WarnOnce: once
    per process). Never raises (``find_safely``). Returns the bypasses."""
    bypasses = find_safely(find, warn)
    for bypass in bypasses:
        warn(bypass.key, bypass.message)
    return bypasses
