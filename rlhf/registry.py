"""Registries of named alternatives, as in verl: a decorator fills them, and an unknown name fails with a
ValueError that lists the valid ones.

The advantage estimators and the loss aggregation modes (rlhf.core_algos) and the KL estimators
(rlhf.kl.estimators) are each one Registry.
"""

from typing import Callable, Iterable


def unknown_name_error(kind: str, name, valid: Iterable[str], plural: str = "names", note: str = "") -> ValueError:
    """`unknown {kind} {name!r}; valid {plural}: a, b, c{note}`, with ` (did you mean 'x'?)` after the name
    when it is the valid name x up to case and spaces."""
    valid = tuple(valid)
    hint = ""
    if isinstance(name, str):
        fixed = name.strip().replace(" ", "").lower()
        if fixed != name and fixed in valid:
            hint = f" (did you mean {fixed!r}?)"
    return ValueError(f"unknown {kind} {name!r}{hint}; valid {plural}: {', '.join(valid)}{note}")


class Registry(dict):
    """Name -> function, in registration order; `kind` and `plural` name them in errors. A name taken or `reserved`
    cannot be registered, and `registry[name]` of one not registered raises unknown_name_error."""

    def __init__(self, kind: str, plural: str = "names", reserved: Callable[[str], bool] = lambda name: False):
        super().__init__()
        self.kind, self.plural, self.reserved = kind, plural, reserved

    def register(self, name: str, *aliases: str) -> Callable[[Callable], Callable]:
        """Decorator: register the function under `name` and each alias, and return it unchanged."""

        def decorator(fn: Callable) -> Callable:
            for n in (name, *aliases):
                if n in self or self.reserved(n):
                    raise ValueError(f"cannot register {self.kind} {n!r}: taken or reserved")
                self[n] = fn
            return fn

        return decorator

    def check(self, name: str) -> str:
        """`name` unchanged if registered; unknown_name_error otherwise."""
        if name not in self:
            raise unknown_name_error(self.kind, name, self, self.plural)
        return name

    def __missing__(self, name: str):
        raise unknown_name_error(self.kind, name, self, self.plural)
