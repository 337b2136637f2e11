"""The documentation keeps its promises: README a user guide of at most 300 lines with no
references to numbered changes, and ``benchmarks/results/`` small, holding only numbers that README,
``docs/`` or a model card cite."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def braces(pattern: str) -> List[str]:
    """``a_{1,2}.json`` -> ``a_1.json``, ``a_2.json`` (nested and repeated groups too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in braces(pattern[:m.start()] + alt + pattern[m.end():])]


def citations() -> List[str]:
    """Every backtick-quoted span of README, docs/*.md and the model cards, braces expanded,
    relative to ``benchmarks/results/`` where it names a path below it."""
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "timm_dora" / "hub" / "actors").glob("*/README.md"))]
    prose = [re.sub(r"```.*?```", " ", p.read_text(), flags=re.S) for p in texts]  # fenced code blocks out
    spans = [" ".join(s.split()) for text in prose for s in re.findall(r"`([^`]+)`", text)]
    out = []
    for span in spans:
        for pattern in braces(span):
            out.append(pattern.split("benchmarks/results/", 1)[-1].split("results/", 1)[-1])
    return out


def is_cited(rel: str, patterns: List[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for p in patterns:
        if p.endswith("/") and rel.startswith(p):  # a cited folder
            return True
        if fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(name, p):
            return True
    return False


def test_citation_matching():
    assert braces("a_{1,2}_{x,y}.json") == ["a_1_x.json", "a_1_y.json", "a_2_x.json", "a_2_y.json"]
    patterns = ["compare_strong/", "throughput_h100_change36_*.json", "train/eval_cpu_x_u*_{qc,dev}.json"]
    patterns = [q for p in patterns for q in braces(p)]
    assert is_cited("compare_strong/a.json", patterns) and is_cited("throughput_h100_change36_vit.json", patterns)
    assert is_cited("train/eval_cpu_x_u00175_dev.json", patterns)
    assert not is_cited("train/eval_cpu_x_u00175_test.json", patterns) and not is_cited("other.json", patterns)


def test_every_result_is_cited():
    files = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    assert len(files) > 20
    patterns = citations()
    assert [f for f in files if not is_cited(f, patterns)] == []


def test_results_are_small():
    size = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert size <= 2 * 2**20, f"{size / 2**20:.2f} MiB"


def test_readme_is_a_user_guide():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert re.findall(r"\b(?:change|changes|issue|issues) #?\d+|#\d+\b", text) == []
    for section in ("## Two commands", "## Usage", "## Supported models", "## The fast path", "## Training a new actor",
                    "## Evaluating and comparing", "## Pretrained actors"):
        assert section in text
