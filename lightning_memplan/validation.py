"""One check per kind of value, shared by every public entry point (house rule for bad input).

Each check names the argument, shows the value (``!r``), states the rule and says how to fix it, and
runs in bounded time whatever the value (no loop linear in a number the user passed). Pure Python:
no torch or Lightning import, so the specs and the CLI can use it before anything heavy is loaded.

- :func:`check_int`: an ``int`` (not ``bool``, not ``2.7``) within ``[minimum, maximum]``.
- :func:`check_number`: a finite real number (not ``bool``, ``nan`` or ``inf``) within bounds.
- :func:`check_bool`: a real ``bool``; the strings ``"no"``/``"False"`` and the ints ``0``/``1`` are
  refused, so a string is never taken as a truth value.
- :func:`check_str`: a ``str`` (optionally ``None``), never a number taken as a label.
- :func:`check_choice`: one of a fixed set of strings.

Every check *returns* the value it accepted as a plain Python ``int``/``float``/``bool``/``str``: a NumPy
scalar (``np.int64(2)``, ``np.float32(0.5)``, ``np.bool_(True)``) or a 0-d tensor (``torch.tensor(2)``)
is converted at the door by :func:`plain_scalar` (``.item()``, exact for integers), so a spec that stores
what its checks return holds plain JSON values (``json.dumps(spec.to_dict())`` works, ints stay exact).
A float-valued scalar is never an int (``np.float64(2.0)`` is refused where an int is asked), and a
bool-valued one never a number.
- :func:`divisor_hint`: the divisors of ``n`` for a message, by trial division up to ``sqrt(n)`` with
  a cap, so a message about ``10**12`` costs microseconds.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = [
    "MAX_DIVISOR_SEARCH",
    "MAX_WORLD_SIZE",
    "check_bool",
    "check_choice",
    "check_int",
    "check_mapping",
    "check_number",
    "check_optional_int",
    "check_str",
    "divisor_hint",
    "divisor_list",
    "divisors",
    "keyword_options",
    "plain_scalar",
    "read_json_file",
]

_T = TypeVar("_T")

#: Most devices (``gpus_per_node * num_nodes``, ``dp * tp * pp * cp``) any spec accepts: 2^24 = 16,777,216,
#: over ten times the largest training cluster announced (about 10^6 accelerators), and small enough that
#: every loop over ranks, stages or divisors stays bounded whatever the user passes.
MAX_WORLD_SIZE = 2**24

#: Largest trial divisor :func:`divisors` tries (so ``n`` up to 10^10 is factored exactly; above it the
#: hint says "a divisor of n"). 10^5 iterations of ``n % d`` take ~10 ms in CPython.
MAX_DIVISOR_SEARCH = 10**5


def _fix(hint: str) -> str:
    return f"; {hint}" if hint else ""


_ARRAY_MODULES = ("numpy", "torch")


def plain_scalar(value: Any) -> Any:
    """A NumPy scalar, a 0-d NumPy array or a 0-d tensor as the Python ``int``/``float``/``bool``/``complex``
    it holds (``.item()``: exact for every integer dtype); any other value unchanged.

    Recognised by the defining module (``numpy``/``torch``), so neither is imported here. A tensor whose
    value cannot be read (on the ``meta`` device) is returned unchanged, and the caller refuses it by type.
    """
    kind = type(value)
    if kind in (int, float, bool, str) or kind.__module__.partition(".")[0] not in _ARRAY_MODULES:
        return value
    if getattr(value, "ndim", None) != 0 or not callable(getattr(value, "item", None)):
        return value
    try:
        item = value.item()
    except (RuntimeError, ValueError, TypeError):  # a meta tensor has no value to read
        return value
    return item if type(item) in (int, float, bool, complex) else value


def check_int(name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None, hint: str = "") -> int:
    """``value`` as an ``int``: a Python/NumPy integer or 0-d integer tensor (:func:`plain_scalar`), not a
    ``bool``, within ``[minimum, maximum]``.

    Raises:
        TypeError: not an integer (``2.7``, ``np.float64(2.0)``, ``"3"``, ``True``, ``None``).
        ValueError: below ``minimum`` or above ``maximum``.
    """
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value  # the common case first: the planner builds thousands of specs
    plain = plain_scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int (got {type(value).__name__}){_fix(hint)}")
    number = int(plain)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}{_fix(hint)}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name}={value!r} must be <= {maximum}{_fix(hint)}")
    return number


def check_optional_int(name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None,
                       hint: str = "") -> int | None:
    """``None``, or :func:`check_int`."""
    return None if value is None else check_int(name, value, minimum=minimum, maximum=maximum, hint=hint)


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = 0.0,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    hint: str = "",
) -> float:
    """``value`` as a finite ``float``: a real number (not ``bool``, not ``nan``/``inf``) within bounds.

    ``minimum``/``maximum`` are inclusive unless ``min_inclusive``/``max_inclusive`` is False.

    Raises:
        TypeError: not a real number (``"1.5"``, ``True``, ``None``, a complex number).
        ValueError: ``nan``, ``inf`` or out of range.
    """
    plain = plain_scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a real number (got {type(value).__name__}){_fix(hint)}")
    try:
        number = float(plain)
    except OverflowError:  # an int beyond float range (10**400)
        raise ValueError(f"{name}={value!r} must be a finite number (it exceeds the float range){_fix(hint)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}={value!r} must be a finite number (not nan or inf){_fix(hint)}")
    if minimum is not None and (number < minimum or (not min_inclusive and number == minimum)):
        rule = ">=" if min_inclusive else ">"
        raise ValueError(f"{name}={value!r} must be {rule} {minimum:g}{_fix(hint)}")
    if maximum is not None and (number > maximum or (not max_inclusive and number == maximum)):
        rule = "<=" if max_inclusive else "<"
        raise ValueError(f"{name}={value!r} must be {rule} {maximum:g}{_fix(hint)}")
    return number


def check_bool(name: str, value: Any, *, hint: str = "") -> bool:
    """``value`` as a ``bool`` when it is one (NumPy's ``bool_`` and a 0-d bool tensor too); nothing else is a
    truth value here.

    Raises:
        TypeError: anything else, e.g. ``"no"``, ``"false"``, ``0``, ``np.int64(1)``, ``None``.
    """
    if isinstance(value, bool):
        return value
    plain = plain_scalar(value)
    if isinstance(plain, bool):
        return plain
    raise TypeError(f"{name}={value!r} must be a bool (got {type(value).__name__}); pass True or False{_fix(hint)}")


def check_str(name: str, value: Any, *, optional: bool = False, hint: str = "") -> str | None:
    """``value`` when it is a ``str`` (or ``None`` with ``optional=True``): a label is never a number.

    Raises:
        TypeError: anything else, e.g. ``123``, ``b"x"``, ``["x"]``.
    """
    if type(value) is str or (optional and value is None):
        return value
    if isinstance(value, str):
        return str(value)  # a str subclass as the plain string it holds
    wanted = "a str or None" if optional else "a str"
    raise TypeError(f"{name}={value!r:.80} must be {wanted} (got {type(value).__name__}){_fix(hint)}")


def check_choice(name: str, value: Any, choices: Iterable[Any], *, hint: str = "") -> Any:
    """``value`` when it is one of ``choices``.

    Raises:
        ValueError: not one of them (an unhashable value is compared by equality, never hashed).
    """
    if type(value) is str and isinstance(choices, tuple) and value in choices:
        return value  # the common case first (a str option of a tuple of str)
    options = tuple(choices)
    if not isinstance(value, bool):
        for option in options:
            if isinstance(value, type(option)) and value == option:
                return option  # the option itself: a str subclass (np.str_) comes back a plain str
    raise ValueError(
        f"{name}={value!r} is not supported; use one of {', '.join(map(repr, options))}{_fix(hint)}"
    )


def check_mapping(name: str, value: Any, required: Iterable[str], *, hint: str = "") -> None:
    """``value`` is a dict holding every key of ``required``.

    Raises:
        TypeError: not a dict.
        ValueError: a key is missing (all missing keys are named).
    """
    if not isinstance(value, dict):
        raise TypeError(f"{name}={value!r:.200} must be a dict{_fix(hint)}")
    missing = [key for key in required if key not in value]
    if missing:
        raise ValueError(f"{name} is missing the key(s) {', '.join(map(repr, missing))}{_fix(hint)}")


def divisors(n: int, *, limit: int = MAX_DIVISOR_SEARCH) -> list[int] | None:
    """All divisors of ``n >= 1`` in increasing order, or ``None`` when ``n > limit**2`` (too large to
    factor by trial division in bounded time). At most ``min(sqrt(n), limit)`` modulo operations."""
    if n < 1:
        return []
    root = math.isqrt(n)
    if root > limit:
        return None
    small = [d for d in range(1, root + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


def divisor_list(n: int, *, keep: int = 8) -> str:
    """``"[1, 2, 4, 8]"`` (``"[1, ..., a, b]"`` with the largest ``keep - 1`` when there are more), or
    ``"the divisors of n"`` when ``n`` is too large to factor in bounded time."""
    found = divisors(n)
    if found is None:
        return f"the divisors of {n}"
    if len(found) > keep:
        return f"[1, ..., {', '.join(map(str, found[-keep + 1:]))}]"
    return str(found)


def divisor_hint(n: int, *, keep: int = 8) -> str:
    """A short phrase for a message: ``"one of [1, 2, 4, 8]"`` (see :func:`divisor_list`), or
    ``"a divisor of n"`` when ``n`` is too large to factor in bounded time."""
    if divisors(n) is None:
        return f"a divisor of {n}"
    return f"one of {divisor_list(n, keep=keep)}"


def read_json_file(path: str | os.PathLike[str], *, what: str = "a JSON file", argument: str = "path") -> Any:
    """Parse the JSON file at ``path``: data only, nothing in it is executed.

    The one reader is :func:`lightning_memplan.files.read_json` (this follows a link at ``path``, a
    user-named file): regular files only, size-capped, strict JSON (``NaN``/``Infinity``, ``1e400`` and
    integers beyond 64 bits are refused, so no non-finite number reaches a size), bounded nesting.

    Raises:
        FileNotFoundError: no such file (the message names the path).
        ValueError: not a regular file, too large, not UTF-8, not JSON, a non-finite number, or nested too
            deep; the message names ``argument``, the path and ``what`` was expected.
    """
    from lightning_memplan.files import read_json  # the one JSON reader (regular files, size, depth, numbers)

    return read_json(path, what=what, argument=argument, follow_links=True)


def keyword_options(cls: type[_T], given: dict[str, Any], *, owner: str, also: Iterable[str] = ()) -> _T:
    """``cls(**given)`` for a keyword-only options dataclass that a front door takes as ``**options``.

    Args:
        cls: the options dataclass (its ``__post_init__`` checks the values).
        given: the keyword arguments collected by ``**options``.
        owner: who took them, for the message (``"MemoryMonitor"``).
        also: the owner's own keyword arguments, listed in the message beside the options.

    Raises:
        TypeError: a name that is not a field of ``cls``, naming it, its value and every valid name.
    """
    import dataclasses

    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(given) - set(known))
    if unknown:
        name = unknown[0]
        raise TypeError(
            f"{owner}({name}={given[name]!r:.80}): unknown option {name!r}; {owner} takes "
            f"{', '.join([*also, *known])}"
        )
    return cls(**given)
