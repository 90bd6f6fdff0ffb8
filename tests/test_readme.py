"""The configuration README shows is one detproxy accepts."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.config import load_settings

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_config_example_loads(tmp_path: Path) -> None:
    (block,) = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    path = tmp_path / "detproxy.toml"
    path.write_text(block)
    settings = load_settings(path)
    assert settings.audit.model_rates == {}
    assert settings.audit.answer_extractor == "json:$.answer"
    assert settings.incidents.path == "/var/log/detproxy/incidents.jsonl"
