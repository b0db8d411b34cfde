"""The restricted unpickler of checkpoint metadata (checkpoint/safe_load.py): it refuses every global a checkpoint
does not hold, before calling anything, and admits the metadata DCP writes for real training states."""

from __future__ import annotations

import io
import os
import pickle
import shlex

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from anytrain.checkpoint import safe_load
from anytrain.config import ModelConfig
from anytrain.models import build_model
from tests.checkpoint_tampering import plant_value, point_outside


class RunsCode:
    """Unpickles as a call of ``target(*args)``: what a crafted checkpoint would plant."""

    def __init__(self, target, *args) -> None:
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def touch(marker) -> RunsCode:
    return RunsCode(os.system, f"touch {shlex.quote(str(marker))}")


def train_state(arch: str) -> dict:
    """A training state as Checkpointer.save writes it: the debug model after one AdamW step (optimizer moments),
    plus schedule / progress values (non-tensor items) and a bf16 and an int64 tensor."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, flavour="debug"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))).backward()
    optimizer.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {
        "train": {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=options),
            "scheduler": {"base_lrs": [1e-3], "last_epoch": 1, "lr_lambdas": [None]},
            "progress": {"step": 1, "tokens_seen": 32},
            "extra": {"bf16": torch.ones(3, dtype=torch.bfloat16), "ids": torch.arange(4)},
        }
    }


def save(state: dict, path) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("arch", ["transformer", "mamba"])
def test_real_metadata_is_admitted_and_equals_plain_unpickling(tmp_path, arch):
    state = train_state(arch)
    save(state, tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        plain = pickle.load(f)
    with open(tmp_path / ".metadata", "rb") as f:
        restricted = safe_load.load_metadata(f, tmp_path / ".metadata")
    assert restricted.state_dict_metadata == plain.state_dict_metadata
    assert restricted.storage_data == plain.storage_data
    assert restricted.storage_meta == plain.storage_meta
    # and the whole checkpoint loads through the safe reader and planner: tensors and non-tensor values
    target = train_state(arch)
    for value in target["train"]["model"].values():
        value.zero_()
    target["train"]["progress"] = {"step": 0, "tokens_seen": 0}
    safe_load.load(target, tmp_path, no_dist=True)
    assert target["train"]["progress"] == {"step": 1, "tokens_seen": 32}
    assert target["train"]["scheduler"] == state["train"]["scheduler"]
    for name, value in state["train"]["model"].items():
        assert torch.equal(target["train"]["model"][name], value), name
    assert torch.equal(target["train"]["extra"]["bf16"], state["train"]["extra"]["bf16"])


@pytest.mark.parametrize(
    "planted",
    [
        lambda marker: touch(marker),
        lambda marker: RunsCode(eval, f"open({str(marker)!r}, 'w')"),
        lambda marker: RunsCode(exec, f"open({str(marker)!r}, 'w')"),
        lambda marker: RunsCode(getattr, RunsCode(__import__, "os"), "system"),
        lambda marker: RunsCode(torch.load, str(marker)),  # module torch, but not a dtype / layout / Size
        lambda marker: RunsCode(pickle.loads, pickle.dumps(touch(marker))),
    ],
    ids=["os.system", "eval", "exec", "getattr", "torch.load", "pickle.loads"],
)
def test_a_planted_global_is_refused_before_anything_runs(tmp_path, planted):
    save({"w": torch.ones(2)}, tmp_path)
    marker = tmp_path / "ran"
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = planted(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(safe_load.UnsafeCheckpointError) as info:
        safe_load.SafeReader(str(tmp_path)).read_metadata()
    message = str(info.value)
    assert message.startswith(f"{tmp_path / '.metadata'}: refusing to load: it names ") and "\n" not in message
    assert "delete it, or restore it from a copy you trust" in message
    with pytest.raises(safe_load.UnsafeCheckpointError):  # dcp.load through the safe reader: the same refusal
        safe_load.load({"w": torch.zeros(2)}, tmp_path, no_dist=True)
    assert not marker.exists()


def test_the_refusal_names_the_global():
    payload = pickle.dumps({"x": touch("/nonexistent/never")})
    with pytest.raises(safe_load.UnsafeCheckpointError, match=r"names (posix|nt)\.system, which"):
        safe_load.MetadataUnpickler(io.BytesIO(payload), "f").load()


def test_a_pickle_of_something_else_is_not_metadata():
    with pytest.raises(ValueError, match="f holds a dict, not DCP checkpoint metadata"):
        safe_load.load_metadata(io.BytesIO(pickle.dumps({"a": [1, 2.0, "x"]})), "f")


def test_a_planted_non_tensor_value_is_refused_naming_its_file(tmp_path):
    """The non-tensor values (schedule, progress) of the .distcp files load with torch.load(weights_only=True)."""
    save({"w": torch.ones(2), "progress": {"step": 3}}, tmp_path)
    marker = tmp_path / "ran"
    shard = plant_value(tmp_path, "progress.step", touch(marker))
    safe_load.SafeReader(str(tmp_path)).read_metadata()  # the metadata itself is plain
    with pytest.raises(safe_load.UnsafeCheckpointError) as info:
        safe_load.load({"w": torch.zeros(2), "progress": {"step": 0}}, tmp_path, no_dist=True)
    message = str(info.value)
    assert message.startswith(f"{shard}: refusing to load: it names posix.system (in progress.step)"), message
    assert "\n" not in message
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../x", "/etc/hostname", "sub/../../x"])
def test_a_storage_path_outside_the_checkpoint_folder_is_refused(tmp_path, where):
    """DCP reads each item from folder / relative_path: an absolute path or one through '..' out of the folder would
    read another file of the machine into the loaded state."""
    checkpoint = tmp_path / "ckpt"
    save({"w": torch.ones(2)}, checkpoint)
    (tmp_path / "x").write_bytes((checkpoint / "__0_0.distcp").read_bytes())  # a loadable file, outside
    file = point_outside(checkpoint, where)
    with pytest.raises(safe_load.UnsafeCheckpointError) as info:
        safe_load.SafeReader(str(checkpoint)).read_metadata()
    message = str(info.value)
    assert message.startswith(f"{file}: refusing to load: the storage entry of w names the file {where!r}, outside")
    assert "\n" not in message and "delete it, or restore it from a copy you trust" in message
    with pytest.raises(safe_load.UnsafeCheckpointError, match="outside the checkpoint folder"):
        safe_load.load({"w": torch.zeros(2)}, checkpoint, no_dist=True)
    (checkpoint / "sub").mkdir()
    point_outside(checkpoint, "sub/../__0_0.distcp")  # a '..' that stays inside is a path like any other
    target = {"w": torch.zeros(2)}
    safe_load.load(target, checkpoint, no_dist=True)
    assert torch.equal(target["w"], torch.ones(2))
