"""hardware.set_attention_backend: the SDPA kernel order it leaves behind (the switches exist in CPU builds too)."""

import pytest
import torch

from anytrain import hardware
from anytrain.errors import ConfigError

NAMES = ("flash", "cudnn", "mem_efficient", "math")


@pytest.fixture
def restore_sdpa():
    flags = {n: getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in NAMES}
    order = torch._C._get_sdp_priority_order()
    yield
    for n, on in flags.items():
        getattr(torch._C, f"_set_sdp_use_{n}")(on)
    torch._C._set_sdp_priority_order(order)


def test_cudnn_first_keeps_the_others_as_fallbacks(monkeypatch, restore_sdpa):
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CUDA)
    before = torch._C._get_sdp_priority_order()
    assert hardware.set_attention_backend("cudnn") == ["cudnn", "flash", "efficient", "math"]
    order = torch._C._get_sdp_priority_order()
    assert order[:4] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION),
                         int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH)]  # fmt: skip
    assert sorted(order) == sorted(before)  # a permutation: nothing dropped
    assert all(getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in NAMES)


@pytest.mark.parametrize("name", ["flash", "efficient"])
def test_flash_or_efficient_first_switches_cudnn_off(name, monkeypatch, restore_sdpa):
    """PyTorch runs cuDNN attention ahead of the priority list whenever it is enabled (a flash-first list still ran
    cuDNN on an H200), so choosing another kernel must switch cuDNN off; the remaining kernels stay as fallbacks."""
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CUDA)
    other = "efficient" if name == "flash" else "flash"
    assert hardware.set_attention_backend(name) == [name, other, "math"]
    assert not torch._C._get_cudnn_sdp_enabled()
    assert torch._C._get_flash_sdp_enabled() and torch._C._get_mem_efficient_sdp_enabled()
    first = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    assert torch._C._get_sdp_priority_order()[0] == int(first)
    hardware.set_attention_backend("cudnn")  # choosing cuDNN again switches it back on
    assert torch._C._get_cudnn_sdp_enabled()


def test_math_only_and_cpu_and_bad_name(monkeypatch, restore_sdpa):
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CUDA)
    hardware.set_attention_backend("math")
    assert not torch._C._get_flash_sdp_enabled() and not torch._C._get_cudnn_sdp_enabled()
    assert torch._C._get_math_sdp_enabled()
    with pytest.raises(ConfigError, match="train.attention_backend"):
        hardware.set_attention_backend("fa3")
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CPU)
    assert hardware.set_attention_backend("cudnn") == []  # CPU: nothing to choose
