"""The run folder's layout (:class:`purerl.io.layout.RunLayout`): one name per file, all under the root."""

from pathlib import Path

import attrs
import pytest

from purerl.io.layout import RunLayout
from purerl.io.metrics import MetricsLog
from purerl.io.records import record_path
from purerl.io.run_folder import RunFolder


def _files(layout: RunLayout) -> list[Path]:
    return [getattr(layout, name) for name, value in vars(RunLayout).items() if isinstance(value, property)]


def test_run_layout_gives_each_file_its_own_name_directly_under_the_root(tmp_path):
    layout = RunLayout(str(tmp_path))
    files = _files(layout)
    assert layout.root == tmp_path and len(files) >= 15
    assert all(path.parent == tmp_path for path in files)
    assert len({path.name for path in files}) == len(files)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.root = Path("elsewhere")  # type: ignore[misc]


def test_step_folders_and_replays_sit_in_their_own_folders(tmp_path):
    layout = RunLayout(tmp_path)
    assert layout.checkpoint(7).parent == layout.checkpoints and layout.record(7).parent == layout.records
    assert layout.checkpoint(7).name == layout.record(7).name == "step_00000007"
    assert record_path(tmp_path, 7) == layout.record(7)
    replay = layout.replay("actor.lr=1e-05,algorithm.x=a/b c")
    assert replay.parent == layout.replays and replay.name == "actor.lr=1e-05,algorithm.x=a_b_c"
    assert RunLayout(replay).metrics.parent == replay and not layout.replays.exists()  # paths only: nothing made


def test_writers_write_where_the_layout_says(tmp_path):
    log = MetricsLog(tmp_path)
    assert (log.path, log.samples_path) == (RunLayout(tmp_path).metrics, RunLayout(tmp_path).samples)
    with RunFolder(tmp_path) as folder:
        assert folder.layout == RunLayout(tmp_path) and RunLayout(tmp_path).lock.exists()
        assert not folder.holds_run()
    RunLayout(tmp_path).baseline.write_text("{}")
    with RunFolder(tmp_path) as folder:
        assert folder.holds_run()
