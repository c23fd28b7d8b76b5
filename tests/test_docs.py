"""The documentation: the site builds without a warning, the API reference is complete, the code
blocks meant to run do run, and the built pages render and navigate in a real browser.

Runnable code is marked in the Markdown with ``<!-- test: run -->`` on the line before a
``python`` fence, or included from a file with pymdownx.snippets (``--8<-- "examples/x.py"``);
included files must be run by another test.
"""
from __future__ import annotations

import html
import importlib
import re
import shutil
import sys
import types
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from conftest import PYTHON, TORCHRUN, check, run

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS = str(Path(sys.executable).parent / "mkdocs")
RUN_MARKER = "<!-- test: run -->"


def markdown_files() -> List[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


# ----- the build ------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` into a temporary folder; any warning fails."""
    out = tmp_path_factory.mktemp("site")
    result = run([MKDOCS, "build", "--strict", "--site-dir", str(out)], timeout=180, cwd=str(ROOT),
                 env={"NO_MKDOCS_2_WARNING": "1"})
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert not re.search(r"^(WARNING|ERROR)\b", log, re.MULTILINE), log[-5000:]
    return out


def test_mkdocs_build_strict_has_no_warning(site):
    for page in ["index.html", "quickstart.html", "tutorials.html", "reference/api.html", "reference/hvd.html",
                 "MIGRATING_FROM_HOROVOD.html", "design/performance.html"]:
        assert (site / page).is_file(), page


def test_api_signatures_are_formatted_not_cut_off(site):
    """mkdocstrings formats long signatures one parameter per line (with Ruff, from the docs extra); without a
    formatter it prints them on one line that the page cuts off at its edge."""
    text = html.unescape(re.sub(r"<[^>]+>", "", (site / "reference" / "api.html").read_text()))
    assert re.search(r"init\(\n +backend: str = \"auto\",\n +\*,\n +timeout: float = 300\.0,", text), \
        text[text.find("init("):text.find("init(") + 400]


# ----- the API reference ----------------------------------------------------------
def public_names() -> Dict[str, List[str]]:
    """Every public name of ``trainbridge`` (its ``__all__``) and of ``trainbridge.hvd`` (Horovod's API)."""
    import trainbridge
    import trainbridge.hvd as hvd

    assert not hvd.using_real_horovod
    hvd_names = [name for name in dir(hvd) if not name.startswith("_")
                 and (not isinstance(getattr(hvd, name), types.ModuleType) or name == "elastic")]
    return {"trainbridge": list(trainbridge.__all__), "trainbridge.hvd": hvd_names}


def test_every_public_name_has_a_docstring_and_is_in_the_api_reference(site):
    import griffe

    package = griffe.load("trainbridge", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    reference = {"trainbridge": DOCS / "reference" / "api.md", "trainbridge.hvd": DOCS / "reference" / "hvd.md"}
    undocumented, unlisted, unrendered = [], [], []
    for module, names in public_names().items():
        text = reference[module].read_text()
        page = (site / "reference" / reference[module].with_suffix(".html").name).read_text()
        for name in names:
            # Listed by its public path, or by where it is defined (trainbridge.spawn: the module
            # trainbridge.api.spawn shadows the function of the same name for static analysis).
            defined = getattr(getattr(importlib.import_module(module), name), "__module__", module)
            path = next((candidate for candidate in (f"{module}.{name}", f"{defined}.{name}")
                         if re.search(rf"^::: {re.escape(candidate)}$", text, re.MULTILINE)), f"{module}.{name}")
            obj = package[path.split(".", 1)[1]]
            if not obj.docstring:
                undocumented.append(path)
            # Methods and properties without a docstring would silently drop out of the reference.
            if obj.is_class:
                undocumented += [f"{path}.{member}" for member, value in obj.members.items()
                                 if not member.startswith("_") and (value.is_function or "property" in value.labels)
                                 and not value.docstring]
            if not re.search(rf"^::: {re.escape(path)}$", text, re.MULTILINE):
                unlisted.append(path)
            if f'id="{path}"' not in page:
                unrendered.append(path)
    assert not undocumented, f"public names without a docstring: {undocumented}"
    assert not unlisted, f"public names missing from the API reference (docs/reference/): {unlisted}"
    assert not unrendered, f"public names the built reference does not show: {unrendered}"


# ----- code that must run ---------------------------------------------------------
def marked_blocks(path: Path) -> List[str]:
    """The ``python`` fences of ``path`` preceded by the run marker."""
    return re.findall(rf"^{re.escape(RUN_MARKER)}\n```python\n(.*?)^```$", path.read_text(), re.MULTILINE | re.DOTALL)


def runnable_blocks() -> List[str]:
    return [block for path in markdown_files() for block in marked_blocks(path)]


def test_the_readme_example_is_the_quickstarts_runnable_one():
    readme = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    quickstart = marked_blocks(DOCS / "quickstart.md")
    assert len(quickstart) == 1 and readme, "the quickstart's loop must be marked with " + RUN_MARKER
    assert all(block in runnable_blocks() for block in readme), "README.md's Python example must be the quickstart's"


@pytest.fixture(scope="module")
def blocks_run(tmp_path_factory):
    """Every runnable block under python and under torchrun with 2 ranks: {launcher: [(folder, result)]}."""
    blocks = runnable_blocks()
    assert blocks
    done = {}
    for launcher in ("python", "torchrun"):
        for number, block in enumerate(blocks):
            folder = tmp_path_factory.mktemp(f"block{number}_{launcher}")
            script = folder / "block.py"
            script.write_text(block)
            cmd = [PYTHON, str(script)] if launcher == "python" else \
                [TORCHRUN, "--standalone", "--nproc-per-node=2", str(script)]
            done.setdefault(launcher, []).append((folder, run(cmd, timeout=120, cwd=str(folder))))
    return done


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_runnable_blocks_run(launcher, blocks_run):
    for _, result in blocks_run[launcher]:
        check(result)
        assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_runnable_blocks_keep_their_promise_of_the_same_weights(blocks_run):
    # "gives the same weights under each": one process and 2 ranks end with the same model (float32 rounding).
    compared = 0
    for (one, _), (two, _) in zip(blocks_run["python"], blocks_run["torchrun"]):
        if (one / "checkpoint.pt").exists():
            a = torch.load(one / "checkpoint.pt", weights_only=True)["model"]
            b = torch.load(two / "checkpoint.pt", weights_only=True)["model"]
            diff = max((a[k] - b[k]).abs().max().item() for k in a)
            assert diff < 1e-5, f"python and torchrun 2 ended {diff:.3g} apart"
            compared += 1
    assert compared


def test_included_files_exist_and_are_run_by_the_tests():
    tests = "".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py") if path.name != "test_docs.py")
    included = {match for path in markdown_files()
                for match in re.findall(r'^\s*--8<-- "([^"]+)"', path.read_text(), re.MULTILINE)}
    assert {"examples/own_loop.py", "examples/horovod_mnist.py"} <= included
    for name in included:
        assert (ROOT / name).is_file(), name
        assert Path(name).name in tests, f"{name} is shown in the docs but no test runs it"


def test_readme_links_point_at_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text()):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


# ----- a real browser -------------------------------------------------------------
def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("headless Chromium is needed to check the built documentation: apt-get install chromium "
                "(scripts/setup.sh installs it)")


def dump_dom(page: Path) -> str:
    result = run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--dump-dom", page.as_uri()], timeout=60)
    assert result.returncode == 0 and "</html>" in result.stdout, result.stderr[-3000:]
    return result.stdout


def test_pages_render_and_navigate_in_chromium(site):
    index = dump_dom(site / "index.html")
    # The navigation as the browser built it: every entry leads to a page that exists.
    nav = re.findall(r'<a href="([^"#]+)(?:#[^"]*)?" class="md-nav__link', index)
    targets = {(site / html.unescape(href)).resolve() for href in nav if not href.startswith("http")}
    assert len(targets) >= 15, nav
    missing = [str(t) for t in targets if not t.is_file()]
    assert not missing, f"navigation links to missing pages: {missing}"
    assert "Your own model and loop" in index and "From the tutorials to trainbridge" in index
    # Follow the navigation to a few pages: their content is there, rendered.
    expect = {"tutorials.html": "Replace mp.spawn", "reference/api.html": 'id="trainbridge.Job.prepare"',
              "quickstart.html": "Save it as", "MIGRATING_FROM_HOROVOD.html": "Every name and its status"}
    for page, text in expect.items():
        assert (site / page).resolve() in targets, page
        dom = dump_dom(site / page)
        assert text in html.unescape(dom), f"{page} does not show {text!r}"
        assert 'class="md-content"' in dom, page
