"""A client's view of the engine it holds: a property forwarded to a dotted path."""

from __future__ import annotations

import operator

__all__ = ["forwarded"]


def forwarded(path: str, doc: str, settable: bool = False) -> property:
    """A property of the value at the dotted ``path`` (a client's view of its engine).

    ``settable``: assigning the property assigns the value there.

    Examples:
        >>> class Client:
        ...     hook = forwarded("engine.hook", "The engine's hook.", settable=True)
        >>> client = Client()
        >>> client.engine = type("Engine", (), {"hook": None})()
        >>> client.hook = print
        >>> client.engine.hook is print
        True
    """
    get = operator.attrgetter(path)
    if not settable:
        return property(get, doc=doc)
    owner, _, name = path.rpartition(".")
    return property(get, lambda self, value: setattr(operator.attrgetter(owner)(self), name, value),
                    doc=doc)  # fmt: skip
