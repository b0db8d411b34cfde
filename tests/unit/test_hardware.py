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
    assert order[:4] == [
        int(SDPBackend.CUDNN_ATTENTION),
        int(SDPBackend.FLASH_ATTENTION),
        int(SDPBackend.EFFICIENT_ATTENTION),
        int(SDPBackend.MATH),
    ]
    assert sorted(order) == sorted(before)  # a permutation: nothing dropped
    assert all(getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in NAMES)


@pytest.mark.parametrize("name", ["flash", "efficient"])
def test_the_order_is_set_after_pytorch_settles_its_default(name, monkeypatch, restore_sdpa):
    """PyTorch writes its default SDPA order at the first attention call of a process (cuDNN first on an H200),
    replacing an order set before: set_attention_backend must make that happen first and then set its own order.
    Here a stand-in for that first call writes the H200's default; cuDNN stays on as a fallback."""
    from torch.nn.attention import SDPBackend

    cudnn_first = [
        int(SDPBackend.CUDNN_ATTENTION),
        int(SDPBackend.FLASH_ATTENTION),
        int(SDPBackend.EFFICIENT_ATTENTION),
        int(SDPBackend.MATH),
    ]
    calls = []
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CUDA)
    monkeypatch.setattr(
        hardware, "settle_sdpa_order", lambda: calls.append(1) or torch._C._set_sdp_priority_order(cudnn_first)
    )
    expected = {"flash": ["flash", "cudnn", "efficient", "math"], "efficient": ["efficient", "flash", "cudnn", "math"]}
    assert hardware.set_attention_backend(name) == expected[name]
    assert calls == [1]
    enum = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    assert torch._C._get_sdp_priority_order()[:4] == [int(enum[n]) for n in expected[name]]
    assert all(getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in NAMES)


def test_math_only_and_cpu_and_bad_name(monkeypatch, restore_sdpa):
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CUDA)
    hardware.set_attention_backend("math")
    assert not torch._C._get_flash_sdp_enabled() and not torch._C._get_cudnn_sdp_enabled()
    assert torch._C._get_math_sdp_enabled()
    with pytest.raises(ConfigError, match="train.attention_backend"):
        hardware.set_attention_backend("fa3")
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CPU)
    assert hardware.set_attention_backend("cudnn") == []  # CPU: nothing to choose


def test_peak_flops_override_is_an_argument(monkeypatch):
    """The MFU peak comes from the catalogue or the caller's override (train.peak_tflops), never the environment."""
    monkeypatch.setenv("ANYTRAIN_PEAK_TFLOPS", "123")
    cpu = torch.device("cpu")
    assert hardware.peak_flops(cpu) is None
    assert hardware.peak_flops(cpu, None) is None and hardware.peak_flops(cpu, 0.0) is None
    assert hardware.peak_flops(cpu, 500.0) == pytest.approx(500e12)
    assert hardware.summary(cpu, 500.0)["peak_bf16_tflops"] == pytest.approx(500.0)
    assert hardware.summary(cpu)["peak_bf16_tflops"] is None


def test_async_tp_refuses_a_cpu_device_in_one_line():
    from anytrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^parallel\.async_tp: needs GPUs .* set --parallel\.async_tp false on CPU$"):
        hardware.enable_async_tp(torch.device("cpu"), "0")


def test_devices_env_narrows_the_visible_list_a_process_was_started_with(monkeypatch):
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.CUDA)
    assert hardware.devices_env([0, 1], {"CUDA_VISIBLE_DEVICES": "2,3"}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert hardware.devices_env([1], {"CUDA_VISIBLE_DEVICES": "5, 7"}) == {"CUDA_VISIBLE_DEVICES": "7"}
    assert hardware.devices_env([0, 2], {}) == {"CUDA_VISIBLE_DEVICES": "0,2"}  # nothing in force: the indices
    monkeypatch.setattr(hardware, "vendor", lambda: hardware.ROCM)
    assert hardware.devices_env([1], {"CUDA_VISIBLE_DEVICES": "4,6"}) == {"HIP_VISIBLE_DEVICES": "6"}


def test_device_uuid_names_a_gpu_only():
    """Benchmarks tell lent machines apart by their GPU's UUID (all of them are called ``vm``); a CPU has none."""
    assert hardware.device_uuid(torch.device("cpu")) is None
    if torch.cuda.is_available():
        assert hardware.device_uuid(torch.device("cuda", 0))
