"""MkDocs hook: docstrings use Sphinx roles (:class:`Job`, :meth:`save`); the site shows just the name."""
import re
from pathlib import Path

SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return SPHINX_ROLE.sub("", html)


# docs/results*.md include files of benchmarks/ (one copy of the figures); their links to the
# folders and charts beside those files name the repository path instead.
INCLUDE = re.compile(r'^--8<-- "(benchmarks/[^"]+)"$', re.MULTILINE)
BENCHMARK_LINK = re.compile(r"(!?)\[[^\]]*\]\(((?:results|baselines)/[^)]*)\)")


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    if not page.file.src_uri.startswith("results"):
        return markdown
    root = Path(config["config_file_path"]).parent
    markdown = INCLUDE.sub(lambda m: (root / m.group(1)).read_text(), markdown)
    return BENCHMARK_LINK.sub(lambda m: f"`benchmarks/{m.group(2)}`" + (" (chart)" if m.group(1) else ""), markdown)
