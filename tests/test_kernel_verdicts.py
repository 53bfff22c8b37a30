"""The kernels' passed self-checks kept per machine (engine/ops/kernels/selfcheck.py, module doc).

On the CPU with stand-in "kernels", as tests/test_kernel_selfcheck.py: ``selfcheck.reset()``
stands for a new process on the same machine (its verdicts gone, the model cache still there).
A pass is kept under the model cache and trusted by a new process without running the kernel or
the reference; a change of kernel source, MLX version, compiler wheels or device checks again;
a failure, a CPU op's verdict and a run with checks off keep nothing; a file that cannot be read
or names another key is ignored.
"""

from __future__ import annotations

import json
import shutil
import warnings

from dflash_batch.engine.ops.kernels import selfcheck

import mlx.core as mx
import pytest

from dflash_batch import paths

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

KERNELS_DIR = paths.kernel_checks_dir  # the package's own, before conftest points it at tmp_path
KEY = (("dtype", mx.bfloat16), ("head_dim", 128), ("causal", True), ("window", None))
OUT = mx.arange(8, dtype=mx.float32)


class Spy:
    """A stand-in kernel or reference returning ``out``, counting its calls."""

    def __init__(self, out):
        self.out, self.calls = out, 0

    def __call__(self):
        self.calls += 1
        return {"out": self.out}


def check(name="block attention", backend="cuda", key=KEY, kernel_out=OUT):
    """One ``verified`` call with counting stand-ins; returns (verdict, kernel, reference, warnings)."""
    kernel, reference = Spy(kernel_out), Spy(OUT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = selfcheck.verified(name, backend, key, kernel, reference, 1e-4)
    return verdict, kernel, reference, list(caught)


def kept_files():
    folder = paths.kernel_checks_dir()
    return sorted(folder.glob("*.json")) if folder.exists() else []


def test_a_pass_is_kept_and_a_new_process_trusts_it():
    verdict, kernel, reference, _ = check()
    assert verdict and kernel.calls == reference.calls == 1
    assert selfcheck.counters() == {"checked": 1, "kept": 0}
    (path,) = kept_files()
    kept = json.loads(path.read_text())
    assert kept["passed"] is True
    assert kept["key"]["kernel"] == "block attention" and kept["key"]["backend"] == "cuda"
    assert kept["key"]["check"] == [
        ["dtype", "bfloat16"],
        ["head_dim", 128],
        ["causal", True],
        ["window", None],
    ]
    assert kept["key"]["sources"] == selfcheck.source_hash()
    assert kept["key"]["mlx"] == mx.__version__
    assert kept["key"]["device"] == {
        k: v for k, v in mx.device_info().items() if k not in ("free_memory", "uuid", "pci_bus_id")
    }

    selfcheck.reset()  # a new process on this machine
    assert selfcheck.known("block attention", "cuda", KEY) is True
    verdict, kernel, reference, _ = check()
    assert verdict and kernel.calls == reference.calls == 0
    assert selfcheck.verdicts() == {("block attention", "cuda") + KEY: True}
    assert selfcheck.counters() == {"checked": 0, "kept": 1}
    # another check key of the same kernel was never checked: it is checked
    verdict, kernel, _, _ = check(key=(("dtype", mx.float16),) + KEY[1:])
    assert verdict and kernel.calls == 1 and len(kept_files()) == 2


def test_the_disk_is_read_once_per_key(monkeypatch):
    """``known`` stays a dictionary look-up: a key with nothing kept is looked for on disk once."""
    reads = []
    real = selfcheck._kept
    monkeypatch.setattr(selfcheck, "_kept", lambda stored: reads.append(stored) or real(stored))
    for _ in range(3):
        assert selfcheck.known("block attention", "cuda", KEY) is None
    assert len(reads) == 1
    check()
    check()
    assert len(reads) == 1


def _copy_of_the_sources(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    shutil.copytree(selfcheck.FOLDER, folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    monkeypatch.setattr(selfcheck, "FOLDER", folder)
    return folder


def _edit_a_nested_source(folder):
    path = folder / "block_attention" / "pass1.inc"
    path.write_bytes(path.read_bytes() + b"\n// edited\n")


def _another_mlx(monkeypatch):
    monkeypatch.setattr(mx, "__version__", mx.__version__ + ".post1")


def _another_device(monkeypatch):
    info = mx.device_info()
    monkeypatch.setattr(mx, "device_info", lambda: {**info, "device_name": "NVIDIA H200"})


def _another_nvrtc(monkeypatch):
    wheels = selfcheck.compilers()
    monkeypatch.setattr(
        selfcheck, "compilers", lambda: {**wheels, "nvidia-cuda-nvrtc-cu12": "12.9.86"}
    )


def _the_same_card_another_moment(monkeypatch):
    """CUDA's free memory, UUID and bus: not the hardware (``device.NOT_HARDWARE``)."""
    info = mx.device_info()
    extra = {"free_memory": 12345, "uuid": "GPU-2", "pci_bus_id": "0000:2a:00.0"}
    monkeypatch.setattr(mx, "device_info", lambda: {**info, **extra})


@pytest.mark.parametrize(
    "change, checks_again",
    [
        ("source", True),
        ("mlx", True),
        ("device", True),
        ("compiler", True),
        ("moment", False),
    ],
)
def test_a_kept_pass_stands_only_for_its_sources_compilers_and_device(
    tmp_path, monkeypatch, change, checks_again
):
    folder = _copy_of_the_sources(tmp_path, monkeypatch)
    assert check()[1].calls == 1
    selfcheck.reset()
    assert check()[1].calls == 0  # the same machine: trusted

    selfcheck.reset()
    if change == "source":
        before = selfcheck.source_hash()
        _edit_a_nested_source(folder)
        assert selfcheck.source_hash() != before
    else:
        {
            "mlx": _another_mlx,
            "device": _another_device,
            "compiler": _another_nvrtc,
            "moment": _the_same_card_another_moment,
        }[change](monkeypatch)
    verdict, kernel, reference, _ = check()
    assert verdict and kernel.calls == reference.calls == int(checks_again)
    assert len(kept_files()) == 1 + int(checks_again)


def test_a_failure_is_not_kept():
    """A failing kernel is checked, and warned about, in every process."""
    for _ in range(2):
        selfcheck.reset()
        verdict, kernel, _, caught = check(kernel_out=OUT + 0.5)
        assert not verdict and kernel.calls == 1 and len(caught) == 1
        assert kept_files() == []


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[]",
        "other key",
        "failed",
        b"\xff\xfe",
    ],
)
def test_a_file_that_cannot_be_read_or_names_another_key_is_ignored(content):
    check()
    (path,) = kept_files()
    if content == "other key":
        kept = json.loads(path.read_text())
        kept["key"]["kernel"] = "few-row matmul"
        content = json.dumps(kept)
    elif content == "failed":
        content = json.dumps({**json.loads(path.read_text()), "passed": False})
    path.write_bytes(content if isinstance(content, bytes) else content.encode())

    selfcheck.reset()
    verdict, kernel, _, caught = check()
    assert verdict and kernel.calls == 1 and caught == []
    assert json.loads(path.read_text())["passed"] is True  # the new pass replaced it
    selfcheck.reset()
    assert check()[1].calls == 0


def test_only_gpu_kernels_are_kept_and_not_with_checks_off(monkeypatch):
    """The native CPU ops' verdicts stay per process (module doc); with checks off or inside
    ``unchecked()`` nothing is checked, read or kept."""
    assert check(name="softmax", backend="cpu", key=(("dtype", "float32"),))[1].calls == 1
    assert kept_files() == []
    with selfcheck.unchecked():
        assert check()[1].calls == 0
    monkeypatch.setenv(selfcheck.ENV, "0")
    assert check()[1].calls == 0
    assert kept_files() == [] and selfcheck.verdicts() == {
        ("softmax", "cpu", ("dtype", "float32")): True
    }


def test_the_folder_is_in_the_model_cache_and_nothing_lands_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "kernel_checks_dir", KERNELS_DIR)
    for name in ("cache", "home", "xdg", "cwd"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path / "cwd")
    before = {p for p in tmp_path.rglob("*") if p.is_file()}
    check()
    written = {p for p in tmp_path.rglob("*") if p.is_file()} - before
    assert paths.kernel_checks_dir() == tmp_path / "cache" / "kernel-checks"
    assert [p.parent for p in written] == [tmp_path / "cache" / "kernel-checks"]
    assert written == set(kept_files())
    selfcheck.reset()
    assert check()[1].calls == 0


def test_an_unwritable_folder_warns_once_and_checks_go_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(paths, "kernel_checks_dir", lambda: blocker / "kernel-checks")
    (ok, kernel, _, caught), (ok_too, _, _, caught_too) = check(), check(key=KEY[:1])
    assert ok and ok_too and kernel.calls == 1 and caught_too == []
    assert len(caught) == 1 and "not kept in" in str(caught[0].message)
