"""Every Triton kernel of the package compiles for the GPUs offline (bench/triton_compile.py): NVIDIA sm_90 (H100 /
H200) and AMD gfx942 (MI300X), at the tiles, dtypes and argument specializations the GPU paths launch at the
realistic shapes of ``triton_compile.CASES`` (captured from the launchers on meta tensors).

The captures and compiles run in a subprocess without ``TRITON_INTERPRET`` (this session's ``@triton.jit`` functions
are interpreted ones). The fast test compiles the Mamba-2 SSD path (mamba2-1.3b, bf16) for sm_90; the slow ones compile
every case for each target and print the registers / spills / shared-memory table (``pytest -s`` or ``-rP`` shows it;
``python -m bench.triton_compile`` prints the same)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env

# Run as a file (not ``-c``): @triton.jit reads its function's source. The autotuned kernel checks that a capture
# records every config of an autotune list (the package has none today).
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dataclasses import asdict

    import triton
    import triton.language as tl

    from bench import triton_compile as tc

    @triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 256})], key=["n"])
    @triton.jit
    def _autotuned_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    def autotuned():
        import torch
        x = torch.empty(4096, device="meta")
        _autotuned_kernel[(1,)](x, x, 4096)

    def main(mode, targets, cases, out):
        doc = {"skip": tc.unsupported()}
        if doc["skip"] is None:
            doc["targets"] = tc.available_targets()
            usable = [t for t in targets if doc["targets"][t] is None]
            if mode == "fast":
                doc["launched"] = sorted({l.kernel.__name__ for v in ("cuda", "rocm") for l in tc.capture(v)})
                doc["kernels"] = sorted(tc.package_kernels())
                tc.CASES["autotuned"] = autotuned
            rows = tc.compile_all(usable, cases)
            doc["rows"] = [asdict(r) for r in rows]
            doc["table"] = tc.table(rows)
        with open(out, "w") as f:
            json.dump(doc, f)

    main(sys.argv[1], sys.argv[2].split(","), [c for c in sys.argv[3].split(",") if c] or None, sys.argv[4])
    """
)


def _run(tmp_path: Path, mode: str, targets: list[str], cases: list[str], timeout: int) -> dict:
    script, out = tmp_path / "compile_kernels.py", tmp_path / "out.json"
    script.write_text(_SCRIPT)
    env = cli_env(PYTHONPATH=f"{ROOT / 'src'}:{ROOT}")
    env.pop("TRITON_INTERPRET", None)
    args = [sys.executable, str(script), mode, ",".join(targets), ",".join(cases), str(out)]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    if doc["skip"]:
        pytest.skip(doc["skip"])
    return doc


def _failures(doc: dict) -> str:
    return "\n\n".join(f"{r['kernel']} {r['target']} {r['config']}\n{r['error']}" for r in doc["rows"] if not r["ok"])


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("triton_compile"), "fast", ["sm90"], ["mamba2-1.3b", "autotuned"], 600)


def test_every_package_kernel_is_launched_by_a_case(fast):
    # a kernel no case launches would go uncompiled: add a case (bench/triton_compile.py CASES) for its GPU path
    assert set(fast["kernels"]) - set(fast["launched"]) == set()


def test_ssd_kernels_compile_for_sm90(fast):
    if fast["targets"]["sm90"]:
        pytest.skip(f"no sm90 backend: {fast['targets']['sm90']}")
    print(fast["table"])
    ssd = {r["kernel"] for r in fast["rows"] if r["kernel"].startswith("_ssd_")}
    assert len(ssd) == 12, ssd  # the five forward and seven backward kernels
    assert not _failures(fast), _failures(fast)
    assert all(r["regs"] and r["shared"] is not None for r in fast["rows"])


def test_every_config_of_an_autotuned_kernel_is_compiled(fast):
    if fast["targets"]["sm90"]:
        pytest.skip(f"no sm90 backend: {fast['targets']['sm90']}")
    configs = sorted(r["config"].split(" ptrs=")[0] for r in fast["rows"] if r["kernel"] == "_autotuned_kernel")
    assert configs == ["BLOCK=256 warps=4 stages=3", "BLOCK=64 warps=2 stages=3"]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm90", "gfx942"])
def test_every_kernel_compiles_for_the_target(tmp_path, target):
    doc = _run(tmp_path, "all", [target], [], 1800)
    if doc["targets"][target]:
        pytest.skip(f"no {target} backend in this Triton: {doc['targets'][target]}")
    print(doc["table"])
    assert not _failures(doc), _failures(doc)
