"""A griffe extension: the library's ``Example:`` docstring sections render as examples.

Griffe's Google-style parser knows ``Examples:`` (plural) as the section whose ``>>>``
lines it renders as code; ``Example:`` becomes an admonition of plain Markdown, where
a doctest's lines run together and its brackets read as links. The library writes
``Example:`` (the Google style guide's spelling, which ruff accepts), so this makes
the site read both the same.
"""

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Renames a docstring's ``Example:`` section to ``Examples:`` as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Called for each object griffe loads; edits its docstring before it is parsed."""
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
