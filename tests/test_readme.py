"""The configuration README shows is one detproxy accepts, and README points only at files a
user of the repository has."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.config import load_settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- sample-config"


def sample_config(text: str) -> str:
    """The ```toml block that follows the sample-config marker."""
    _, marker, after = text.partition(MARKER)
    assert marker, f"README.md has no {MARKER} ... --> marker before its sample configuration"
    found = re.search(r"```toml\n(.*?)```", after, re.S)
    assert found, "README.md has no ```toml block after its sample-config marker"
    return found.group(1)


def test_readme_config_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "detproxy.toml"
    path.write_text(sample_config(README.read_text()))
    settings = load_settings(path)
    assert settings.audit.model_rates == {}
    assert settings.audit.answer_extractor == "json:$.answer"
    assert settings.incidents.path == "/var/lib/detproxy/incidents.jsonl"


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_links_only_files_in_the_repository() -> None:
    text = README.read_text()
    outside = [line for line in text.splitlines() if re.search(r"(?<!\.)\.\./|shared/|SPEC", line)]
    assert not outside, f"README.md points outside the repository: {outside[:3]}"
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if "://" in target:
            continue
        path = ROOT / target if target else README
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"README.md links files or headings that do not exist: {broken}"
