"""The README's embedding example, run as written: saved as serve.py and started as a user would, at
tp 1 and tp 2, with preemption by offload and a weight update mid-run. Its outputs equal the toy
model's by hand, its stream carried every token (the script asserts it), and at tp 2 the output
depends on what rank 1 wrote, through ``WorkerPort.all_reduce_sum``: rank 1 writing other K values
changes it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def snippet() -> str:
    section = (ROOT / "README.md").read_text().split("## Embedding fastkv in a Paddle deployment", 1)[1]
    return re.search(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S).group(1)


def reference(tp: int) -> dict[str, list[int]]:
    """The toy model by hand: each rank writes token + rank as K; the next token is the sum of every
    rank's K over the whole context, mod 1000."""
    out = {}
    for i in range(8):
        tokens = [i + 1] * (5 + i)
        for _ in range(16):
            tokens.append((tp * sum(tokens) + len(tokens) * sum(range(tp))) % 1000)
        out[f"req-{i}"] = tokens[5 + i:]
    return out


def serve(tmp_path: Path, tp: int, code: str) -> dict[str, list[int]]:
    script = tmp_path / "serve.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script), str(tp)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    preempted = json.loads(err.strip().splitlines()[-1])
    assert preempted["offload"] > 0, preempted  # the small device tier made it offload
    assert not [p for p in Path("/dev/shm").iterdir() if f"fkv.serve{proc.pid}." in p.name]  # its run id
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [1, 2])
def test_the_readme_example_serves_the_toy_models_tokens(tmp_path, tp):
    assert serve(tmp_path, tp, snippet()) == reference(tp)


def test_at_tp2_the_output_depends_on_what_rank_1_wrote(tmp_path):
    code = snippet()
    assert code.count("(seq.token_ids + rank)") == 1
    wrong = serve(tmp_path, 2, code.replace("(seq.token_ids + rank)", "(seq.token_ids + 2 * rank)"))
    assert wrong.keys() == reference(2).keys()
    assert all(wrong[rid] != ref for rid, ref in reference(2).items())
