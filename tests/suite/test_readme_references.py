"""Every README section the product's own messages send a user to exists: a quoted name after
"see the README, " in rtd_scale/ is a heading of README.md or a bold lead-in of a paragraph
(``**What the main job shows.**``). The run summary's plateau verdict once named a section that
had been renamed."""
from __future__ import annotations

import re

from tests.helpers.env import REPO

CITED = re.compile(r'see the README, \\?"([^"\\]+)\\?"')


def _cited() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "rtd_scale").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for name in CITED.findall(" ".join(text.split())):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_readme_section_a_message_names_exists():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    titles = {m.strip() for m in re.findall(r"^#+ (.+)$", readme, flags=re.M)}
    titles |= {m.rstrip(".").strip() for m in re.findall(r"\*\*([^*]+)\*\*", readme)}
    cited = _cited()
    assert "What the main job shows" in cited  # the summary's verdicts (training/summary.py)
    missing = {name: files for name, files in cited.items() if name not in titles}
    assert not missing, missing
    assert "What 300 CPU steps can and cannot show" not in titles  # the name that had gone
