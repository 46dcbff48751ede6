"""Every ```python block of README.md appears verbatim in a file of examples/, which the example tests run
(tests/deepspeed/test_examples.py, tests/hf/test_example.py): the README shows only code that runs.

"Verbatim": line for line, as a run of consecutive lines of the file, ignoring the block's leading and
trailing blank lines, trailing spaces, and the indentation the lines share (a block may quote the body
of a function). Pure text: no process group, no import of collgrad.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
LANGUAGES = ("python", "py")


def python_blocks(markdown: str) -> list[tuple[int, str]]:
    """The ```python blocks of ``markdown``: (line number of the opening fence, text), in order."""
    blocks: list[tuple[int, str]] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```") and fence[3:].strip().lower() in LANGUAGES:
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise AssertionError(f"README.md:{i + 1}: a ```python block is never closed")
            blocks.append((i + 1, "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


def normalized(text: str) -> list[str]:
    """``text``'s lines without trailing spaces, shared indentation, leading and trailing blank lines."""
    lines = textwrap.dedent("\n".join(line.rstrip() for line in text.splitlines())).splitlines()
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def found_in(block: str, source: str) -> bool:
    """Whether ``block`` is a run of consecutive lines of ``source``, up to shared indentation."""
    want = normalized(block)
    if not want:
        return True
    have = [line.rstrip() for line in source.splitlines()]
    first = want[0].strip()
    for start in range(len(have) - len(want) + 1):
        if have[start].strip() == first and normalized("\n".join(have[start : start + len(want)])) == want:
            return True
    return False


def where(block: str, sources: dict[str, str]) -> str | None:
    """The name of the first source holding ``block``, or None."""
    return next((name for name, text in sources.items() if found_in(block, text)), None)


def _examples() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(EXAMPLES.glob("*.py"))}


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5, f"README.md has {len(BLOCKS)} ```python blocks"


@pytest.mark.parametrize("line, block", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_every_python_block_is_quoted_from_an_example(line, block):
    examples = _examples()
    assert where(block, examples) is not None, (
        f"README.md:{line}: this ```python block is not, line for line, in any of examples/"
        f"{', examples/'.join(examples)}; quote it from an example (which a test runs) or change the example:\n" + block
    )


def test_the_check_finds_a_quoted_block_and_misses_an_altered_one():
    source = textwrap.dedent(
        """\
        def train(rank):
            grads = collgrad.safe_get_full_model_grads(engine)

            for name, grad in collgrad.iter_full_model_grads(engine):
                print(name)
            engine.step()
        """
    )
    readme = textwrap.dedent(
        """\
        Text.

        ```python
        grads = collgrad.safe_get_full_model_grads(engine)

        for name, grad in collgrad.iter_full_model_grads(engine):
            print(name)
        ```

        ```bash
        not python: never checked
        ```

          ```python
          engine.step()
          ```

        ```python
        grads = collgrad.safe_get_full_model_grads(engine)
        engine.step()
        ```

        ```python
        grads = collgrad.safe_get_full_model_grads(model)
        ```
        """
    )
    blocks = python_blocks(readme)
    assert [line for line, _ in blocks] == [3, 14, 18, 23]
    found = [where(block, {"example.py": source}) for _, block in blocks]
    # quoted (blank line inside, shared indentation removed), quoted (a fence indented in a list),
    # lines of the file but not consecutive, one word changed
    assert found == ["example.py", "example.py", None, None]


def test_the_check_reports_an_unclosed_block():
    with pytest.raises(AssertionError, match="never closed"):
        python_blocks("```python\nx = 1\n")
