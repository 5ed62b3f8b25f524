"""One escaping helper per medium, for every string that comes from a file or a user (a model's class name,
a config.json ``model_type``, a report's notes, incident texts or component keys) on its way to a page, a
Markdown file, a terminal or rich markup (one helper per medium; CWE-79, CWE-150).

- HTML (:func:`html_text`): ``html.escape(quote=True)``, for element text and quoted attribute values
  (https://html.spec.whatwg.org/multipage/syntax.html#escapingString); the Unicode bidirectional
  embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) become ``U+FFFD`` first, since an
  escaped ``&#x202e;`` still reorders the text after it on the page (CVE-2021-42574, "Trojan Source").
- Markdown (:func:`markdown_text`, :func:`markdown_code`, :func:`markdown_code_block`): CommonMark's
  backslash escape of every ASCII punctuation character that has a meaning (CommonMark 0.31, section 2.4
  "Backslash escapes"), so ``<img onerror=...>`` is text, not a tag, and ``|`` does not split a table
  cell; ``&`` becomes ``&amp;`` (section 2.5, entity references). Code spans and blocks use a fence longer
  than any backtick run inside (sections 6.1 and 4.5), so no text closes them early.
- Terminal (:func:`terminal_text`): every C0 and C1 control character (ESC, BEL, the 8-bit CSI ``\\x9b``,
  so no OSC 0 window title, OSC 52 clipboard write or CSI clear-screen; ECMA-48 section 5) and the Unicode
  bidirectional overrides (CVE-2021-42574) become ``U+FFFD``; ``\\n`` is kept where lines are meaningful.
- rich markup (:func:`rich_text`): the terminal escape, then :func:`rich.markup.escape`, so ``[/bogus]``
  prints literally instead of raising ``MarkupError``. ``rich.text.Text`` objects are not markup and
  need only :func:`terminal_text`.
"""

from __future__ import annotations

import html
import re
from typing import Any

__all__ = ["html_text", "markdown_code", "markdown_code_block", "markdown_text", "rich_text", "terminal_text"]

#: C0 controls except TAB and LF, DEL, C1 controls, and the bidirectional embedding/override/isolate marks.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROLS_AND_NEWLINES = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_REPLACEMENT = "\ufffd"
#: The ASCII punctuation that starts or ends Markdown syntax (CommonMark section 2.4 allows escaping any;
#: ``~`` is GitHub's strikethrough).
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()<>#+\-.!|~])")
_BACKTICKS = re.compile(r"`+")


#: The bidirectional embedding/override/isolate marks alone (they reorder text wherever they are shown).
_BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")


def html_text(value: Any) -> str:
    """``str(value)`` safe as HTML element text or a quoted attribute value (``& < > " '`` escaped, the
    bidirectional overrides as ``U+FFFD``)."""
    return html.escape(_BIDI.sub(_REPLACEMENT, str(value)), quote=True)


def terminal_text(value: Any, *, newlines: bool = True) -> str:
    """``str(value)`` safe to print to a terminal: control characters (ESC, BEL, CSI, ...) and bidirectional
    overrides become ``U+FFFD``; ``\\n`` (and ``\\t``) stay when ``newlines``, else ``\\n`` becomes one too."""
    return (_CONTROLS if newlines else _CONTROLS_AND_NEWLINES).sub(_REPLACEMENT, str(value))


def markdown_text(value: Any) -> str:
    """``str(value)`` as inline CommonMark text that renders as exactly these characters: punctuation
    backslash-escaped (no emphasis, link, raw HTML, heading or table cell break can start), ``&`` as
    ``&amp;``, line breaks as spaces (one line stays one line), control characters as ``U+FFFD``."""
    text = terminal_text(value, newlines=False).replace("\t", " ")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text).replace("&", "&amp;")


def _longest_backtick_run(text: str) -> int:
    return max((len(m) for m in _BACKTICKS.findall(text)), default=0)


def markdown_code(value: Any) -> str:
    """``str(value)`` as one CommonMark code span: fenced by one backtick more than the longest backtick
    run inside, padded with a space when the text starts or ends with a backtick (section 6.1); control
    characters as ``U+FFFD``, line breaks as spaces. Inside a code span nothing is markup, HTML included."""
    text = terminal_text(value, newlines=False).replace("\t", " ")
    fence = "`" * (_longest_backtick_run(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_code_block(value: Any) -> str:
    """``str(value)`` as a fenced CommonMark code block (lines kept): the fence is at least three backticks
    and longer than any backtick run inside, so no line closes it (section 4.5)."""
    text = terminal_text(value).rstrip("\n")
    fence = "`" * max(3, _longest_backtick_run(text) + 1)
    return f"{fence}\n{text}\n{fence}"


def rich_text(value: Any, *, newlines: bool = True) -> str:
    """``str(value)`` safe inside a rich markup string (a table cell, a title, ``console.print``):
    :func:`terminal_text` and then ``rich.markup.escape``."""
    from rich.markup import escape

    return escape(terminal_text(value, newlines=newlines))
