"""MkDocs hook: docstrings use Sphinx roles (:class:`Job`, :meth:`save`); the site shows just the name."""
import re

SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return SPHINX_ROLE.sub("", html)
