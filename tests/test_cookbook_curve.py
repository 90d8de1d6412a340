"""``bench/cookbook_curve.py``: a tinker-cookbook RL run's curve and its first-against-last summary."""

import importlib.util
import json
import sys
from pathlib import Path

from tests import processes

_PATH = Path(__file__).parents[1] / "bench" / "cookbook_curve.py"
_SPEC = importlib.util.spec_from_file_location("cookbook_curve", _PATH)
cookbook_curve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cookbook_curve)


def _metrics(path: Path, correct: list[float]) -> Path:
    rows = [{"step": s, "env/all/correct": c, "env/all/format": 1.0, "env/all/reward/total": c}
            for s, c in enumerate(correct)]
    rows.reverse()  # the rows are read in step order whatever their order in the file
    rows.append({"step": len(correct), "tokens/cumulative/sampled": 10})  # the loop's last row: no rollout metrics
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_curve_is_drawn_and_its_ends_compared(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", [0.0] * 3 + [0.5] * 3)
    assert [row["step"] for row in cookbook_curve.step_rows(metrics)] == list(range(6))
    out = processes.run([sys.executable, str(_PATH), str(metrics), "--out", str(tmp_path / "c.png"), "--window", "3"],
                         check=True).stdout
    assert "0.000 over steps 0-2, 0.500 over steps 3-5 (+0.500)" in out
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_too_short_a_run_is_refused_in_one_line(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", [0.0] * 3)
    done = processes.run([sys.executable, str(_PATH), str(metrics), "--out", str(tmp_path / "c.png")])
    assert done.returncode != 0 and "3 steps with rollout metrics, fewer than 2 × --window (10)" in done.stderr
    done = processes.run([sys.executable, str(_PATH), str(metrics), "--out", str(tmp_path / "c.png"), "--window", "0"])
    assert done.returncode != 0 and "--window 0: average at least 1 step at each end" in done.stderr
