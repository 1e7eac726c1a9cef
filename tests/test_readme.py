"""The README's Python examples run as written and print what they say they print."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(README), "exec"), {})
        for line in block.splitlines():
            if "print(" in line and "#" in line:
                expected = line.split("#", 1)[1].strip()
                assert expected in out.getvalue(), (expected, out.getvalue())
