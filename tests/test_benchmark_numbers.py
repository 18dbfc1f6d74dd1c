"""Every measured number the README quotes is in ``benchmarks/RESULTS.md``, whose sections
each name the machine, versions and commit they were measured on and the committed script
that wrote them: a README number that no run produced, or one a new run replaced, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
# a number with a unit of time or a ratio, as the README quotes measurements: "0.079 s",
# "~50 ms", "3×"
QUOTED = re.compile(r"(~)?\b(\d+(?:\.\d+)?)\s?(ms|s|µs|×)(?![\w-])")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def quoted(text: str) -> list[tuple[bool, str]]:
    return [(bool(m[1]), m[2]) for m in QUOTED.finditer(text)]


def measured(results: str) -> set[float]:
    return {float(n) for n in NUMBER.findall(results)}


def found(number: str, about: bool, numbers: set[float]) -> bool:
    """``number`` as RESULTS.md has it, to the README's precision (within 10% for "~")."""
    value = float(number)
    if about:
        return any(abs(n - value) <= 0.1 * value for n in numbers)
    places = len(number.split(".")[1]) if "." in number else 0
    return any(round(n, places) == value for n in numbers)


def test_every_measurement_the_readme_quotes_is_in_the_results():
    numbers = measured((ROOT / "benchmarks" / "RESULTS.md").read_text())
    readme = quoted((ROOT / "README.md").read_text())
    assert readme, "the README quotes no measurement: is the pattern still right?"
    missing = [f"{'~' if about else ''}{n}" for about, n in readme if not found(n, about, numbers)]
    assert not missing, f"README numbers that benchmarks/RESULTS.md does not hold: {missing}"


def test_every_results_section_names_its_machine():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    for section in text.split("\n## ")[1:]:
        title, body = section.split("\n", 1)
        if re.match(r"\d", title):  # the sections run.py writes
            assert body.strip().startswith("_Measured "), f"section {title!r} names no machine"
