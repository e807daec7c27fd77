"""Markdown helpers shared by the generators."""

from __future__ import annotations

import html
import re


def md_text(text: str) -> str:
    """Plain text for Markdown: HTML-escaped outside backtick spans, one line, ``|`` escaped
    (it goes into table cells)."""
    parts = re.split(r"(`[^`]*`)", rst_inline(" ".join(text.split())))
    out = [p if p.startswith("`") and p.endswith("`") and len(p) > 1 else html.escape(p,
                                                                                      quote=False)
           for p in parts]
    return "".join(out).replace("|", "\\|")


def code(text: str) -> str:
    """An inline code span that survives any backticks inside and a table cell's ``|``."""
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def block(text: str, lang: str = "text") -> list[str]:
    return [f"```{lang}", text.rstrip("\n"), "```", ""]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def rst_inline(text: str) -> str:
    text = re.sub(r":(?:class|mod|func|data|attr|meth):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def toc_slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (mkdocs' default)."""
    from markdown.extensions.toc import slugify

    return slugify(heading.replace("`", ""), "-")
