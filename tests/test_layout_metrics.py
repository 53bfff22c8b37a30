"""benchmarks/layout_metrics.py counts what it says, on a made-up package whose faults are known."""

from __future__ import annotations

from benchmarks import layout_metrics

KERNEL = '''SOURCE = """
    uint i = thread_position_in_grid.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
"""
'''


def write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_metrics_find_circles_upward_arrows_reads_kernels_and_long_lines(tmp_path):
    write(tmp_path, {
        "dflash_batch/__init__.py": "",
        "dflash_batch/environment.py": "import os\nos.environ.get('A')\nos.environ['A'] = 'b'\n",
        "dflash_batch/engine/__init__.py": "",
        "dflash_batch/engine/loop.py": "from . import other\nfrom .ops import add\n",
        "dflash_batch/engine/other.py": "from . import loop\nimport os\nx = os.environ.get('A')  # 3.2 ms on an H200\n",
        "dflash_batch/engine/ops/__init__.py": "",
        "dflash_batch/engine/ops/add.py": "from ..models import target\n" + KERNEL + "y = 1  # " + "x" * 100 + "\n",
        "dflash_batch/engine/models/__init__.py": "",
        "dflash_batch/engine/models/target.py": "from ..ops import add\nfrom .. import loop\n",
        "benchmarks/b.py": "from dflash_batch.engine.engine import _pick\nfrom dflash_batch.engine import loop\n",
    })  # fmt: skip
    got = layout_metrics.measure(tmp_path)
    assert got["engine_modules"] == 4
    assert got["import_circles"] == [
        ["dflash_batch.engine.loop", "dflash_batch.engine.models.target", "dflash_batch.engine.ops.add",
         "dflash_batch.engine.other"]]  # fmt: skip
    assert got["upward_arrows"] == [
        "dflash_batch.engine.models.target -> dflash_batch.engine.loop",
        "dflash_batch.engine.ops.add -> dflash_batch.engine.models.target",
    ]
    assert got["environment_reads"] == 1 and got["environment_read_files"] == {
        "dflash_batch/engine/other.py": 1
    }
    assert got["environment_table_lines"] == 2  # the one accessor's own, counted apart
    assert got["kernel_source_lines_in_py"] == 5
    assert got["lines_over_100"] == 1 and got["figure_lines"] == 1
    assert got["benchmark_engine_internal_imports"] == 1
    assert got["benchmark_private_imports"] == ["b.py: dflash_batch.engine.engine._pick"]


def test_the_metrics_run_on_this_checkout():
    got = layout_metrics.measure(layout_metrics.ROOT)
    assert got["engine_modules"] > 20 and got["import_circles"] == [] and got["upward_arrows"] == []
    assert got["environment_reads"] == 0 and got["environment_table_lines"] > 0
