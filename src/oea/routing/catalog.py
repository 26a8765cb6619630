"""Policies by name, for tools that take ``--policy`` style strings (simulator, evaluation, reports).

``make_policy("oea", k0=3)`` -> ``OEAConfig(k0=3)``; ``make_policy("vanilla")`` -> ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from oea.routing.comparators import BudgetConfig, SubtractiveConfig
from oea.routing.ep import EPOEAConfig, ExpertPlacement
from oea.routing.schedules import AdaptiveK0Config
from oea.routing.spec import OEAConfig, PrunedConfig


def _ep_oea(k0: int, placement: ExpertPlacement | None = None, ep: int | None = None,
            num_experts: int | None = None, **options: Any) -> EPOEAConfig:
    if placement is None:
        if ep is None or num_experts is None:
            raise ValueError("policy 'ep-oea' needs placement=ExpertPlacement or ep=N with num_experts=N")
        placement = ExpertPlacement.contiguous(num_experts, ep)
    return EPOEAConfig(k0, placement, **options)


def _needs(name: str, option: str, options: dict[str, Any]) -> Any:
    if option not in options:
        raise ValueError(f"policy {name!r} needs the option {option}=...")
    return options.pop(option)


_FACTORIES: dict[str, Callable[..., object | None]] = {
    "vanilla": lambda k0=None, **_: None,
    "pruned": lambda k0, **options: PrunedConfig(k0, **options),
    "oea": lambda k0, **options: OEAConfig(k0, **options),
    "ep-oea": _ep_oea,
    "budget": lambda k0=None, **options: BudgetConfig(_needs("budget", "budget", options), **options),
    "subtractive": lambda k0=None, **options: SubtractiveConfig(_needs("subtractive", "target", options), **options),
    "adaptive": lambda k0=None, **options: AdaptiveK0Config(
        tuple(map(tuple, _needs("adaptive", "schedule", options))), **options
    ),
}
_NEEDS_K0: set[str] = {"pruned", "oea", "ep-oea"}


def _fields(config: type, *extra: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(config) if f.name != "k0") + extra


# The options each built-in name takes (``make_policy`` names an unknown one and lists these).
_OPTIONS: dict[str, tuple[str, ...]] = {
    "vanilla": (),
    "pruned": _fields(PrunedConfig),
    "oea": _fields(OEAConfig),
    "ep-oea": _fields(EPOEAConfig, "ep", "num_experts"),
    "budget": _fields(BudgetConfig),
    "subtractive": _fields(SubtractiveConfig),
    "adaptive": _fields(AdaptiveK0Config),
}


def register_policy_name(
    name: str, factory: Callable[..., object | None], needs_k0: bool = True, options: tuple[str, ...] | None = None
) -> None:
    """Make ``name`` available to ``make_policy``; ``factory(k0=..., **options)`` returns a config.

    ``options``: the option names the factory takes (``make_policy`` then names any other one);
    ``None`` leaves the check to the factory.
    """
    _FACTORIES[name] = factory
    if needs_k0:
        _NEEDS_K0.add(name)
    if options is None:
        _OPTIONS.pop(name, None)
    else:
        _OPTIONS[name] = tuple(options)


def policy_options(name: str) -> tuple[str, ...] | None:
    """The option names ``make_policy(name, ...)`` accepts (``None``: not declared by its factory)."""
    if name not in _FACTORIES:
        raise ValueError(f"policy must be one of {policy_names()}, got {name!r}")
    return _OPTIONS.get(name)


def policy_names() -> list[str]:
    """Every policy name ``make_policy`` accepts."""
    return sorted(_FACTORIES)


def needs_k0(name: str) -> bool:
    """True when the policy takes a k0 (everything but ``vanilla``)."""
    return name in _NEEDS_K0


def make_policy(name: str, k0: int | None = None, **options: Any) -> object | None:
    """Build the config of policy ``name``; raises ``ValueError`` listing the valid names."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"policy must be one of {policy_names()}, got {name!r}")
    if name in _NEEDS_K0 and k0 is None:
        raise ValueError(f"policy {name!r} needs k0")
    allowed = _OPTIONS.get(name)
    unknown = sorted(set(options) - set(allowed)) if allowed is not None else []
    if unknown:
        raise ValueError(f"policy {name!r} has no option {', '.join(map(repr, unknown))}; its options are "
                         f"{list(allowed) or 'none'}")
    try:
        return factory(k0=k0, **options)
    except TypeError as err:  # an undeclared option of a registered factory, or a value of the wrong type
        raise ValueError(f"policy {name!r}: {err}") from None
