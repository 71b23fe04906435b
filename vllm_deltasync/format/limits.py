"""What a bucket may hold: the one definition of a valid tensor name, tensor shape and step
number (``resumed_from`` included).

The manifest's validation refuses a bucket that breaks these rules when it is read
(``_manifest_schema.py``), and the publisher and the writer refuse the same things before
anything is written (``trainer/publisher.py`` at ``publish``, ``trainer/options.py`` at
construction, ``writer.py`` for every step it writes): a step the writer commits is a step
every reader reads. Each ``*_problem`` function returns what is wrong, in words that follow
the object's name (``tensor 'x' <problem>``), or None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_deltasync.format.layout import MAX_STEP

MAX_NAME_CHARS = 1024
"""Longest tensor name, in characters."""
MAX_NDIM = 8
"""Most dimensions a tensor may have."""
MAX_NUMEL = 1 << 40
"""Most elements one tensor may claim (2 TiB of bf16): a larger claim is refused by the parser
before anything is sized by it."""


def name_problem(name: object) -> str | None:
    """What makes ``name`` no valid tensor name (a string of 1 to 1024 characters, no NUL,
    encodable as UTF-8), or None."""
    if not isinstance(name, str):
        return f"has a name of type {type(name).__name__}, not a string"
    if not name:
        return "has an empty name"
    if len(name) > MAX_NAME_CHARS:
        return f"has a name of {len(name)} characters, more than {MAX_NAME_CHARS}"
    if "\x00" in name:
        return "has a name holding NUL"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "has a name that is not valid Unicode (it holds a lone surrogate)"
    return None


def shape_problem(shape: Sequence[object]) -> str | None:
    """What makes ``shape`` no valid tensor shape (at most 8 integers >= 0, at most 2**40
    elements), or None."""
    if len(shape) > MAX_NDIM:
        return f"has {len(shape)} dimensions, more than {MAX_NDIM}"
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"has a shape {str(list(shape))[:80]} that is not integers >= 0"
    numel = math.prod(shape)  # type: ignore[arg-type]  # checked: integers
    if numel > MAX_NUMEL:
        return (f"has shape {list(shape)}, which claims {numel} elements, more than a tensor "
                f"may have ({MAX_NUMEL})")
    return None


def step_problem(value: object) -> str | None:
    """What makes ``value`` no step number (an integer in [0, 10**12 - 1]: steps are named by
    12 digits; ``resumed_from`` is one too), or None; the caller shows the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "is not an integer"
    if not 0 <= value <= MAX_STEP:
        return f"is outside [0, {MAX_STEP}] (steps are named by 12 digits)"
    return None


def shown(value: object) -> str:
    """``repr(value)`` cut to 40 characters, for a message (an integer too long to print too)."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python prints
        return "an integer of thousands of digits"
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = ["MAX_NAME_CHARS", "MAX_NDIM", "MAX_NUMEL", "MAX_STEP", "name_problem", "shape_problem",
           "shown", "step_problem"]
