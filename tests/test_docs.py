"""The README and the guides: every Python block runs as written and prints what it says
it prints, every relative link leads to a file, and the mkdocs site builds strictly with
an API reference of every top-level name."""

import ast
import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

import jax_adaptive as ja

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(page, block, id=f"{page.relative_to(ROOT)}:{i}")
    for page in PAGES
    for i, block in enumerate(
        re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M), 1
    )
]


def test_the_readme_and_every_guide_have_python_examples():
    pages = {param.values[0] for param in BLOCKS}
    assert ROOT / "README.md" in pages and len(pages) >= 10


def expected_prints(block):
    """The comment after each ``print(...)`` statement (on its last line): what it prints."""
    lines = block.splitlines()
    calls = [
        node
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "print"
    ]
    ends = [lines[call.end_lineno - 1][call.end_col_offset :] for call in calls]
    return [end.split("#", 1)[1].strip() for end in ends if "#" in end]


@pytest.mark.parametrize("page, block", BLOCKS)
def test_python_block_runs(page, block):
    """Each block on its own (fresh globals), as a reader would paste it; a statement
    ``print(...)  # text`` must print ``text``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(page), "exec"), {"__name__": "__main__"})
    for expected in expected_prints(block):
        assert expected in out.getvalue(), (expected, out.getvalue())


def test_every_expected_print_is_found():
    block = "print(1)  # 1\nprint(\n    2,\n)  # 2\nx = 3  # not a print\nprint(4)\n"
    assert expected_prints(block) == ["1", "2"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_lead_to_files(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [x for x in links if "://" not in x and not (page.parent / x).exists()]
    assert not missing


def test_the_readme_test_command_is_the_ci_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f'pip install -e ".[test]" && {ci}' in (ROOT / "README.md").read_text()


def test_the_api_reference_and_the_site_cover_every_page_and_top_level_name():
    api = (ROOT / "docs" / "api.md").read_text()
    assert sorted(re.findall(r"^::: jax_adaptive\.(\w+)$", api, re.M)) == sorted(ja.__all__)
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = set(re.findall(r"[\w-]+\.md", str(nav)))
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page or a docstring the API
    reference cannot render fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", tmp_path]
    result = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    assert [name for name in ja.__all__ if f'id="jax_adaptive.{name}"' not in api] == []
