"""benchmarks/vllm_serving.py runs end to end (--quick): every server, order and number of
requests has its row, each request generated all its tokens (the script checks each answer),
and the figures are consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_serving_benchmark_fills_its_table(tmp_path):
    out = tmp_path / "serving.json"
    script = REPO / "benchmarks" / "vllm_serving.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    rows = {(r["server"], r["mode"], r["concurrency"]): r for r in got["rows"]}
    servers = ("vLLM", "anyorder serve", "anyorder sampler")
    assert set(rows) == {(s, m, c) for s in servers for m in ("l2r", "random") for c in (1, 2)}
    for (_, _, c), r in rows.items():
        assert r["seconds"] > 0
        assert abs(r["tokens_per_s"] - c * got["generated"] / r["seconds"]) < 1e-6
    assert set(got["random_over_l2r"]) == {"1", "2"}
    assert "vLLM, random order over left to right" in run.stdout
