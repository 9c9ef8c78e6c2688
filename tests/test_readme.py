"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path, monkeypatch):
    section = README.read_text().split("## Python example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["generated"].shape == (2, 24)
    assert namespace["loss"].item() > 0


def test_readme_and_card_pipelines_put_no_end_of_text_after_the_prompt():
    """A ByT5 tokenizer (the smoke preset's) appends </s> to every text unless told not to; the quickstart's, the
    README's and the model card's pipeline calls tell it (tests/test_train_e2e.py runs such a call on an export)."""
    quickstart = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    generating = README.read_text().split("### Generating from an exported model", 1)[1].split("\n### ", 1)[0]
    card = (README.parent / "model_cards" / "nsa_model_card.md").read_text()
    card_pipeline = card.split("With a transformers pipeline", 1)[1].split("```", 2)[1]
    for name, text in (("quickstart", quickstart), ("generating", generating), ("card", card_pipeline)):
        calls = text.count("generator(") + text.count(")('")  # the pipeline called (the quickstart: inline)
        assert calls, name
        assert text.count("add_special_tokens=False") >= calls, (name, calls)
