"""docs/FORMATS.md documents every field the code writes to summary.json, results.jsonl and
report.json, and no field the code does not write.

The summary's keys are read from the source of the functions that build it (an AST walk over
their dict literals and ``summary["..."] =`` assignments), so a key added there without a line
in the doc fails here.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

from fastkv.cli import report
from fastkv.engine import engine, health, metrics
from fastkv.engine.core import RequestResult
from fastkv.engine.handoff import HandoffStats
from fastkv.engine.lookup import LookupStats
from fastkv.run import VERIFY_COUNTERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "FORMATS.md"


def documented(section: str) -> set[str]:
    """The keys in the first column of the table under ``## <section>``."""
    text = DOC.read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/FORMATS.md has no section {section!r}"
    return set(re.findall(r"^\| `([^`]+)` \|", m.group(1), re.M))


def _top(keys: set[str]) -> set[str]:
    return {k for k in keys if "." not in k}


def _nested(keys: set[str], parent: str) -> set[str]:
    return {k.split(".", 1)[1] for k in keys if k.startswith(parent + ".")}


def _dict_keys(fn, name: str | None = None) -> set[str]:
    """String keys of the dict literals in ``fn``'s source (only the outermost ones: those not
    values of another dict), plus those assigned ``name["key"] = ...``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    nested = {id(d) for node in ast.walk(tree) if isinstance(node, ast.Dict) for v in node.values
              for d in ast.walk(v) if isinstance(d, ast.Dict)}
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and id(node) not in nested:
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if name and isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name
                        and isinstance(t.slice, ast.Constant)):
                    keys.add(t.slice.value)
    return keys


def test_summary_keys_match_the_engine():
    doc = documented("summary.json")
    written = (_dict_keys(engine.summarize) | _dict_keys(health.counters) | _dict_keys(metrics.EngineMetrics.summary)
               | _dict_keys(engine.serve_workload, "summary") | _dict_keys(engine.write_missing))
    assert set(report.SUMMARY_KEYS) <= written
    assert _top(doc) == written, (f"undocumented: {sorted(written - _top(doc))}; "
                                  f"documented but not written: {sorted(_top(doc) - written)}")


def test_summary_nested_keys_match_their_producers():
    doc = documented("summary.json")
    assert _nested(doc, "verified") == set(VERIFY_COUNTERS)
    assert _nested(doc, "handoff") == set(HandoffStats("prefill").to_json())
    lookup = set(LookupStats().to_json()) | {"bytes_loaded", "blocks_loaded", "loads_joined"}  # health.counters
    assert _nested(doc, "storage_lookup") == lookup
    for key, names in (("preemptions", report.MODES), ("hit_ratio", report.TIERS)):
        row = re.search(rf"^\| `{key}` \| (.*)$", DOC.read_text(), re.M).group(1)
        assert all(f"`{n}`" in row for n in names), (key, row)


def test_results_keys_match_request_result():
    assert documented("results.jsonl") == set(RequestResult._fields)


def test_report_keys_match_build(tmp_path):
    summary = {k: {} for k in report.SUMMARY_KEYS}
    results = [RequestResult("a", [1], "length", 0.1, 0.2, 1, 0).to_json(),
               {**RequestResult("b", [], "rejected", None, None, 0, 0, "rejected", "too long").to_json()}]
    data = report.build(summary, json.loads(json.dumps(results)))
    assert documented("report.json") == set(data) - set(summary)
