"""The README's Python examples run as written and print what they say they print."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(block):
    """Each block on its own (fresh globals), as a reader would paste it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    for line in block.splitlines():
        if "print(" in line and "#" in line:
            expected = line.split("#", 1)[1].strip()
            assert expected in out.getvalue(), (expected, out.getvalue())
