"""Dataclasses to and from the JSON the store keeps, driven by their fields and type hints.

The app stores the engine's own dataclasses (SamplingParams) and its own (AppSettings,
ChatSettings) the same way, so no class restates its fields to save or load itself. Loading
is forgiving: stored JSON may come from an older version or be edited by hand, so unknown
keys are ignored and a value of the wrong type, or one the class's own validation refuses,
keeps its default instead of failing the whole load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


def to_json(obj: Any) -> dict[str, Any]:
    """The dataclass as plain JSON-ready values (nested dataclasses included)."""
    return dataclasses.asdict(obj)


def from_json(cls: type[T], data: Any) -> T:
    """An instance of `cls` from stored JSON: defaults for what is missing or refused."""
    if not isinstance(data, dict):
        return cls()
    values = {}
    for name, load in _loaders(cls):
        if name in data:
            with contextlib.suppress(TypeError, ValueError):  # wrong type: the default
                values[name] = load(data[name])
    try:
        return cls(**values)  # the usual case: all of it valid, one construction
    except (TypeError, ValueError):
        out = cls()
        for name, value in values.items():  # keep what the class's validation accepts
            try:
                out = dataclasses.replace(out, **{name: value})
            except (TypeError, ValueError):
                continue
        return out


Loader = Callable[[Any], Any]


@functools.cache
def _loaders(cls: type) -> tuple[tuple[str, Loader], ...]:
    """Each field's name and its loader, worked out once per class from its type hints
    (resolving hints costs more than loading a record)."""
    hints = get_type_hints(cls)
    return tuple((f.name, _loader(hints[f.name])) for f in dataclasses.fields(cls))


def _loader(hint: Any) -> Loader:
    """A function turning stored JSON into a value of type `hint`, or raising TypeError or
    ValueError when it cannot."""
    if dataclasses.is_dataclass(hint):
        return functools.partial(_load_object, hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:  # e.g. bool | str: the stored value must be one of them as is
            return functools.partial(_load_one_of, tuple(options))
        (inner,) = [_loader(a) for a in options]
        if type(None) not in args:
            return inner
        return lambda v: None if v is None or v == "" else inner(v)
    if origin is tuple:
        item = _loader(args[0])
        return functools.partial(_load_tuple, item)
    if hint is bool:
        return bool
    if hint in (int, float):
        return hint
    if hint is str:
        return _load_text
    return functools.partial(_refuse, hint)


def _load_one_of(types_: tuple[type, ...], value: Any) -> Any:
    """A value of a union of plain types (SamplingParams.early_stopping: bool | str), taken
    as stored when its JSON type is one of them exactly (True is not taken for an int)."""
    if type(value) in types_:
        return value
    raise TypeError(f"expected one of {types_!r}, got {value!r}")


def _load_object(cls: type, value: Any) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {value!r}")
    return from_json(cls, value)


def _load_tuple(item: Loader, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"expected a list, got {value!r}")
    return tuple(item(v) for v in value)


def _load_text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {value!r}")
    return value


def _refuse(hint: Any, value: Any) -> Any:
    raise TypeError(f"cannot load a {hint!r}")
