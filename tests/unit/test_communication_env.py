"""parallel.nccl_protocol / nccl_min_ctas / nccl_max_ctas: the NCCL variables each process sets before its process
group starts, a conflicting variable in the environment refused with one line, bad values refused at config load."""

from __future__ import annotations

import pytest

from anytrain import hardware
from anytrain.config import ParallelConfig, load_config
from anytrain.errors import ConfigError
from anytrain.parallel.mesh import init_distributed
from tests.conftest import ROOT, run_cli


def test_fields_map_to_the_nccl_variables_and_unset_fields_to_nothing():
    assert hardware.communication_env(ParallelConfig()) == {}
    fields = ParallelConfig(nccl_protocol="LL128", nccl_min_ctas=2, nccl_max_ctas=16)
    assert hardware.communication_env(fields) == {"NCCL_PROTO": "LL128", "NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "16"}


def test_init_sets_them_and_refuses_a_different_value_already_set(monkeypatch):
    for var in ("NCCL_PROTO", "NCCL_MAX_CTAS"):
        monkeypatch.delenv(var, raising=False)
    env = hardware.communication_env(ParallelConfig(nccl_protocol="Simple", nccl_max_ctas=8))
    init_distributed("cpu", comm_env=env)  # one process: no group, the variables set all the same
    assert hardware.os.environ["NCCL_PROTO"] == "Simple" and hardware.os.environ["NCCL_MAX_CTAS"] == "8"
    init_distributed("cpu", comm_env=env)  # the same values again: fine
    monkeypatch.setenv("NCCL_PROTO", "LL")
    with pytest.raises(ConfigError, match=r"parallel.nccl_protocol: Simple but the environment has NCCL_PROTO=LL"):
        init_distributed("cpu", comm_env=env)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("--parallel.nccl_protocol", "fast"), "parallel.nccl_protocol: expected one of"),
        (("--parallel.nccl_max_ctas", "-1"), "parallel.nccl_max_ctas: expected a thread-block count >= 0"),
        (("--parallel.nccl_min_ctas", "8", "--parallel.nccl_max_ctas", "4"), "parallel.nccl_min_ctas: 8 is above"),
    ],
)
def test_bad_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs/tiny.yaml", list(overrides))


def test_a_run_with_a_conflicting_environment_stops_before_training(tmp_path, small_data):
    args = [
        "train",
        str(ROOT / "configs/tiny.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--data.path",
        str(small_data),
    ]
    proc = run_cli(*args, "--train.steps", "1", "--parallel.nccl_protocol", "Simple", NCCL_PROTO="LL")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: parallel.nccl_protocol: Simple but the environment")
