"""docs/configuration.md is generated from the configuration classes' field docstrings and must equal the
generator's output, so that it cannot drift from the code."""

from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from kvbridge.serving import config_docs
from kvbridge.serving.config_docs import COMMAND, Section, render, section_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_checked_in_page_is_the_generated_one():
    assert PAGE.read_text(encoding="utf-8") == render(), f"docs/configuration.md is out of date; run: {COMMAND}"


def test_every_field_of_every_section_is_on_the_page():
    page = render()
    for section in config_docs.SECTIONS:
        for field in msgspec.inspect.type_info(section.cls).fields:
            assert f"| `{field.name}` |" in page


class Documented(msgspec.Struct, kw_only=True):
    limit: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 64
    """How many | at most."""

    chunk_bytes: int = 8 << 20
    """A chunk,
    over two lines."""


class Undocumented(msgspec.Struct, kw_only=True):
    limit: int = 1
    """Documented."""

    other: int = 2


def test_a_row_carries_type_default_bounds_and_the_docstring():
    rows = section_markdown(Section(Documented, "t", "i"))
    assert "| `limit` | integer | `64` | ≥ 1, ≤ 2^20 | How many \\| at most. |" in rows
    assert "| `chunk_bytes` | integer | `8388608` (8 MiB) | – | A chunk, over two lines. |" in rows


def test_a_field_without_a_docstring_is_refused_by_name():
    with pytest.raises(ValueError, match="Undocumented: fields without a docstring: other"):
        section_markdown(Section(Undocumented, "t", "i"))


def test_check_fails_on_a_stale_page_and_names_the_command(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text(render(), encoding="utf-8")
    assert config_docs.main(["--check", str(page)]) == 0
    page.write_text(render().replace("Longest wait", "Shortest wait"), encoding="utf-8")  # negative control
    assert config_docs.main(["--check", str(page)]) == 1
    assert COMMAND in capsys.readouterr().err


def test_asterisks_outside_code_are_not_emphasis():
    assert config_docs._cell("base + (dp*pp_size + pp)*tp_size, `a*b`") == "base + (dp\\*pp_size + pp)\\*tp_size, `a*b`"
