"""Dataclasses to and from the JSON the store keeps, driven by their fields and type hints.

The app stores the engine's own dataclasses (SamplingParams) and its own (AppSettings,
ChatSettings) the same way, so no class restates its fields to save or load itself. Loading
is forgiving: stored JSON may come from an older version or be edited by hand, so unknown
keys are ignored and a value of the wrong type, or one the class's own validation refuses,
keeps its default instead of failing the whole load.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


def to_json(obj: Any) -> dict[str, Any]:
    """The dataclass as plain JSON-ready values (nested dataclasses included)."""
    return dataclasses.asdict(obj)


def from_json(cls: type[T], data: Any) -> T:
    """An instance of `cls` from stored JSON: defaults for what is missing or refused."""
    out = cls()
    if not isinstance(data, dict):
        return out
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        try:
            value = _coerce(hints[f.name], data[f.name])
            out = dataclasses.replace(out, **{f.name: value})  # runs the class's validation
        except (TypeError, ValueError):
            continue
    return out


def _coerce(hint: Any, value: Any) -> Any:
    """`value` as the type `hint` names (TypeError/ValueError when it cannot be)."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {value!r}")
        return from_json(hint, value)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if type(None) in args and value in (None, ""):
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _coerce(hint, value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {value!r}")
        return tuple(_coerce(args[0], v) for v in value)
    if hint is bool:
        return bool(value)
    if hint in (int, float):
        return hint(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"expected text, got {value!r}")
        return value
    raise TypeError(f"cannot load a {hint!r}")
