"""The one module that knows CUDA from ROCm from CPU.

Everything else asks here: which device to use, which collective backend, whether bf16 / fused AdamW / Triton
are usable, the peak dense bf16 FLOP/s used for MFU, and memory statistics. ROCm builds of PyTorch expose
AMD GPUs through the ``torch.cuda`` namespace (HIP), so "is this a GPU" and "which vendor" are separate
questions: ``torch.cuda.is_available()`` is true on both, ``torch.version.hip`` is set only on ROCm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from anytrain.errors import ConfigError

CPU, CUDA, ROCM = "cpu", "cuda", "rocm"


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures of one accelerator as PyTorch sees it (one device = one GCD/die on MI250/MI250X).

    Peaks are dense (no sparsity) bf16 tensor-core rates; bandwidths are per device.
    """

    name: str
    peak_bf16_tflops: float
    memory_gib: float
    hbm_tb_per_s: float
    tdp_watts: float
    intra_node_gb_per_s: float  # per direction, per device (NVLink / Infinity Fabric)
    inter_node_gb_per_s: float  # per device NIC share, typical deployment


# Matched against torch.cuda.get_device_name() by substring, most specific first.
DEVICE_CATALOGUE: tuple[tuple[str, DeviceSpec], ...] = (
    ("H200", DeviceSpec("H200 SXM", 989.0, 141.0, 4.8, 700.0, 450.0, 50.0)),
    ("H100 PCIe", DeviceSpec("H100 PCIe", 756.0, 80.0, 2.0, 350.0, 64.0, 25.0)),
    ("H100", DeviceSpec("H100 SXM", 989.0, 80.0, 3.35, 700.0, 450.0, 50.0)),
    ("A100-SXM4-40GB", DeviceSpec("A100 40GB", 312.0, 40.0, 1.555, 400.0, 300.0, 25.0)),
    ("A100", DeviceSpec("A100 80GB", 312.0, 80.0, 2.039, 400.0, 300.0, 25.0)),
    ("V100", DeviceSpec("V100", 125.0, 32.0, 0.9, 300.0, 150.0, 12.5)),
    ("MI300X", DeviceSpec("MI300X", 1307.0, 192.0, 5.3, 750.0, 448.0, 50.0)),
    # MI250X / MI250: one PyTorch device is one graphics compute die (half a card).
    ("MI250X", DeviceSpec("MI250X (per GCD)", 191.5, 64.0, 1.6, 280.0, 100.0, 25.0)),
    ("MI250", DeviceSpec("MI250 (per GCD)", 181.0, 64.0, 1.6, 280.0, 100.0, 25.0)),
)

# For planning only (never matched against a device name: PyTorch sees one GCD per device): a whole MI250X / MI250
# card = two GCDs counted as one device (2 x peak, memory, HBM bandwidth; the card's TDP).
CARD_CATALOGUE: tuple[tuple[str, DeviceSpec], ...] = (
    ("MI250X card", DeviceSpec("MI250X (card, 2 GCDs)", 383.0, 128.0, 3.2, 560.0, 200.0, 50.0)),
    ("MI250 card", DeviceSpec("MI250 (card, 2 GCDs)", 362.0, 128.0, 3.2, 560.0, 200.0, 50.0)),
)


def vendor() -> str:
    """'cuda' (NVIDIA), 'rocm' (AMD) or 'cpu' for the accelerator this process can use."""
    if not torch.cuda.is_available():
        return CPU
    return ROCM if getattr(torch.version, "hip", None) else CUDA


def is_gpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def resolve_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """Pick the device for this process. 'auto' = the local_rank-th GPU if any, else CPU."""
    if requested not in ("auto", "cpu", "cuda", "gpu"):
        raise ConfigError(f"device: unknown value {requested!r}; use auto, cpu or gpu")
    if requested == "cpu" or (requested == "auto" and vendor() == CPU):
        return torch.device("cpu")
    if vendor() == CPU:
        raise ConfigError("device: a GPU was requested but none is visible (check CUDA/HIP_VISIBLE_DEVICES)")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def dist_backend(device: torch.device) -> str:
    """Collective backend: NCCL on NVIDIA, RCCL on AMD (PyTorch calls both 'nccl'), gloo on CPU."""
    return "nccl" if is_gpu(device) else "gloo"


def device_name(device: torch.device) -> str:
    if is_gpu(device):
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_spec(device: torch.device) -> DeviceSpec | None:
    """Catalogue entry for this device, or None (CPU or unknown GPU)."""
    if not is_gpu(device):
        return None
    name = torch.cuda.get_device_name(device)
    return lookup_spec(name)


def lookup_spec(name: str) -> DeviceSpec | None:
    for key, spec in DEVICE_CATALOGUE:
        if key.lower() in name.lower():
            return spec
    return None


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device for MFU; None where no honest peak exists (CPU, unknown GPU).

    ``override_tflops`` (the config's ``train.peak_tflops``; None or 0 = the catalogue) replaces the catalogue value,
    e.g. for a GPU missing from it.
    """
    if override_tflops:
        return float(override_tflops) * 1e12
    spec = device_spec(device)
    return spec.peak_bf16_tflops * 1e12 if spec else None


def supports_bf16(device: torch.device) -> bool:
    return is_gpu(device) and torch.cuda.is_bf16_supported()


def fused_adamw_available(device: torch.device) -> bool:
    """torch's fused AdamW kernel exists for CUDA and ROCm tensors (and CPU from torch 2.4, but it is slower)."""
    return is_gpu(device)


FP8_ROCM_ARCHS = {"gfx942": "fnuz", "gfx950": "ocp"}
"""AMD GPUs with FP8 matrix cores, and their formats: MI300 (gfx942) has the fnuz formats (e4m3fnuz / e5m2fnuz, no
negative zero, one NaN), MI350 (gfx950) the OCP ones as NVIDIA does (e4m3fn / e5m2)."""


def fp8_dtypes(device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(e4m3, e5m2) float8 dtypes of this device: the fnuz pair on gfx942, the OCP pair everywhere else (NVIDIA, gfx950,
    and the CPU, where FP8 is only emulated)."""
    if is_gpu(device) and vendor() == ROCM and _rocm_arch(device) == "gfx942":
        return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    return torch.float8_e4m3fn, torch.float8_e5m2


def _rocm_arch(device: torch.device) -> str:
    """The gfx name of an AMD GPU (``gcnArchName`` without its feature suffix, e.g. gfx942)."""
    return str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")).split(":")[0]


def fp8_support(device: torch.device, rowwise: bool = False) -> str | None:
    """None when this device can train with FP8 matmuls (``torch._scaled_mm`` with per-tensor, or with ``rowwise``
    per-row scales), else why not, in words: NVIDIA needs compute capability 8.9 or newer, AMD gfx942 or gfx950, and
    the PyTorch build must run the scaled matmul (one tiny call checks it); a CPU has no FP8 matmul."""
    if not is_gpu(device):
        return "the CPU has no FP8 matmul"
    name = torch.cuda.get_device_name(device)
    if vendor() == ROCM:
        arch = _rocm_arch(device)
        if arch not in FP8_ROCM_ARCHS:
            return f"{name} ({arch}) has no FP8 matrix cores (needs {' or '.join(FP8_ROCM_ARCHS)})"
    else:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores (needs 8.9 or newer)"
    e4m3, _ = fp8_dtypes(device)
    try:  # (16, 32) @ (32, 16), the second operand column-major as _scaled_mm requires
        a = torch.zeros(16, 32, device=device).to(e4m3)
        b = torch.zeros(16, 32, device=device).to(e4m3).t()
        one = torch.ones((), device=device)
        scales = (one.expand(16, 1).contiguous(), one.expand(1, 16).contiguous()) if rowwise else (one, one)
        torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kind = "row-wise" if rowwise else "tensor-wise"
        return f"this PyTorch build cannot run {kind} scaled FP8 matmuls on {name} ({first})"
    return None


def triton_interpreted() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1: kernels run as Python on CPU tensors; tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device) -> bool:
    """Triton kernels run on NVIDIA and AMD GPUs; on CPU only in the interpreter (TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return is_gpu(device) or triton_interpreted()


def synchronize(device: torch.device) -> None:
    if is_gpu(device):
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if is_gpu(device):
        torch.cuda.reset_peak_memory_stats(device)


def record_memory_history(device: torch.device, enabled: bool) -> None:
    """Start (or stop) recording the caching allocator's allocations and frees with their Python stacks (CUDA and
    ROCm: HIP's allocator is the same one). A CPU device has no such allocator: ValueError."""
    if not is_gpu(device):
        raise ValueError("the allocator's history exists on CUDA/ROCm GPUs only")
    if enabled:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def memory_allocated_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds in tensors now (0 on CPU: not tracked)."""
    return torch.cuda.memory_allocated(device) if is_gpu(device) else 0


def memory_snapshot(device: torch.device) -> dict:
    """The allocator's segments and its recorded trace (``torch.cuda.memory._snapshot``; see record_memory_history)."""
    if not is_gpu(device):
        raise ValueError("the allocator's history exists on CUDA/ROCm GPUs only")
    return torch.cuda.memory._snapshot(device)


def peak_memory_gib(device: torch.device, reserved: bool = False) -> float:
    """Peak bytes held by the caching allocator since the last reset, in GiB (0.0 on CPU: not tracked).

    ``reserved``: the peak of the memory the allocator reserved instead of the tensors allocated in it. Use it for
    CUDA-graph replays measured after a reset that followed the capture: the graph's activations live in its private
    pool, whose blocks count as free (not allocated) between replays, so that allocated peak leaves them out (a peak
    that spans the capture, as a training run's does, includes them)."""
    if is_gpu(device):
        peak = torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated
        return peak(device) / 2**30
    return 0.0


def memory_capacity(device: torch.device) -> int | None:
    """Bytes of memory the device has: a GPU's total memory, or on the CPU the host's physical RAM (None where the
    operating system does not say)."""
    if is_gpu(device):
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


def settle_sdpa_order() -> None:
    """Make PyTorch set its default SDPA priority order now, so that an order set afterwards is the one used.

    PyTorch sets that default once per process, at its first SDPA dispatch decision on a GPU, and it replaces any order
    set before then (with recent cuDNN versions: [cudnn, flash, efficient, math]). One decision
    on tiny tensors triggers it.
    """
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None or not torch.cuda.is_available():
        return
    q = torch.zeros(1, 1, 16, 64, device="cuda", dtype=torch.float16)
    choice(q, q, q)


def set_attention_backend(name: str) -> list[str]:
    """Put one SDPA kernel first for this process (GPUs only; 'auto' leaves PyTorch's order). Returns the order.

    Uses the global priority list when torch has it (the chosen kernel first, the rest as fallbacks for shapes it
    cannot take), set after ``settle_sdpa_order`` (PyTorch would otherwise replace it at the first attention call);
    else the per-kernel enable switches (math always stays on as the last resort). Must run before blocks are
    compiled: compiled graphs keep the kernel chosen while tracing. cuDNN attention exists on NVIDIA only; on ROCm
    'cudnn' falls back to the next kernel in the list.
    """
    if name == "auto" or vendor() == CPU:
        return []
    if name not in SDPA_BACKENDS:
        raise ConfigError(f"train.attention_backend: unknown {name!r}; use auto, {', '.join(SDPA_BACKENDS)}")
    from torch.nn.attention import SDPBackend

    enum = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    order = [name, *[b for b in SDPA_BACKENDS if b != name]] if name != "math" else ["math"]
    switches = {
        "flash": torch.backends.cuda.enable_flash_sdp,
        "cudnn": torch.backends.cuda.enable_cudnn_sdp,
        "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    }
    getter, setter = (getattr(torch._C, f"_{v}_sdp_priority_order", None) for v in ("get", "set"))
    if getter is None or setter is None:  # older torch: only the chosen kernel (and math) stays on
        order = [name, "math"] if name != "math" else order
    for backend, enable in switches.items():
        enable(backend in order)
    if getter is not None and setter is not None:
        settle_sdpa_order()
        wanted = [int(enum[b]) for b in order]
        setter(wanted + [v for v in getter() if v not in wanted])  # unnamed backends keep their places after
    return order


def apply_env_defaults() -> None:
    """Per-vendor environment defaults, set only where the user has not set them."""
    # Surface NCCL/RCCL errors as exceptions instead of hangs (same variable on both vendors).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if vendor() == ROCM:
        # hipBLASLt is the fast GEMM path on MI200/MI300 with recent ROCm.
        os.environ.setdefault("TORCH_BLAS_PREFER_HIPBLASLT", "1")


COMMUNICATION_ENV = {"nccl_protocol": "NCCL_PROTO", "nccl_min_ctas": "NCCL_MIN_CTAS", "nccl_max_ctas": "NCCL_MAX_CTAS"}
"""parallel.<field> -> the environment variable NCCL reads at communicator creation (RCCL reads the same names)."""


def communication_env(parallel: Any) -> dict[str, str]:
    """The environment the ``parallel.nccl_*`` fields ask for (unset fields: nothing)."""
    values = {name: getattr(parallel, name) for name in COMMUNICATION_ENV}
    return {COMMUNICATION_ENV[name]: str(value) for name, value in values.items() if value not in ("", 0)}


def apply_communication_env(env: dict[str, str]) -> None:
    """Set ``env`` (``communication_env``) in this process before its process group starts; a variable the user set
    to another value is a ConfigError naming the field (the config is what the run directory records)."""
    field = {var: name for name, var in COMMUNICATION_ENV.items()}
    for var, value in env.items():
        have = os.environ.get(var)
        if have is not None and have != value:
            raise ConfigError(
                f"parallel.{field[var]}: {value} but the environment has {var}={have}; unset {var} or set the "
                f"field to {have}"
            )
        os.environ[var] = value


def enable_async_tp(device: torch.device, group_name: str) -> None:
    """Switch on inductor's micro-pipelined tensor parallelism (all-gather/matmul and matmul/reduce-scatter fused over
    symmetric memory) for the process group ``group_name``. Raises ConfigError where it cannot run: CPU devices
    (gloo has no symmetric memory) and GPUs whose PyTorch build lacks it."""
    if not is_gpu(device):
        raise ConfigError(
            "parallel.async_tp: needs GPUs (symmetric memory between the tensor-parallel ranks); set "
            "--parallel.async_tp false on CPU"
        )
    try:
        import torch._inductor.config as inductor_config
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as exc:  # a build without symmetric memory
        raise ConfigError(
            f"parallel.async_tp: this PyTorch build has no symmetric memory ({exc}); set --parallel.async_tp false"
        ) from exc
    inductor_config._micro_pipeline_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed by older releases, a no-op in newer ones
    if enable is not None:
        enable(group_name)


def topology_command() -> list[str] | None:
    """The vendor tool that prints the GPU interconnect matrix (NVLink / PCIe / NUMA affinity), or None on CPU."""
    if vendor() == CUDA:
        return ["nvidia-smi", "topo", "-m"]
    if vendor() == ROCM:
        return ["rocm-smi", "--showtopo"]
    return None


def single_device_env(device: torch.device, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables that make a child process see only ``device`` (as its device 0); empty on CPU. See devices_env."""
    if not is_gpu(device):
        return {}
    return devices_env([device.index or 0], environ)


def devices_env(indices: list[int], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables that make a child process see only the GPUs ``indices`` (as its devices 0, 1, ...), indices counted
    as this process sees them: the visible-devices list of this vendor, narrowed to those entries of any list already
    in force (CUDA_VISIBLE_DEVICES; HIP_VISIBLE_DEVICES on ROCm, whose indices count inside any ROCR_VISIBLE_DEVICES,
    which the child inherits)."""
    environ = dict(os.environ) if environ is None else environ
    key = "HIP_VISIBLE_DEVICES" if vendor() == ROCM else "CUDA_VISIBLE_DEVICES"
    visible = environ.get(key) or (environ.get("CUDA_VISIBLE_DEVICES") if vendor() == ROCM else None)
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    return {key: ",".join(entries[i] if i < len(entries) else str(i) for i in indices)}


def device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (CUDA and ROCm alike through torch), None on the CPU or where torch does not report one. Lent
    machines share one host name; this tells two machines apart."""
    if not is_gpu(device):
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    return uuid if uuid.strip("0-") else None  # an all-zero UUID (some VMs) names nothing


def summary(device: torch.device, peak_tflops: float | None = None) -> dict:
    """Versions and device facts recorded with every run and benchmark (``peak_tflops``: as for ``peak_flops``)."""
    info = {
        "vendor": vendor() if is_gpu(device) else CPU,
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "peak_bf16_tflops": (peak_flops(device, peak_tflops) or 0.0) / 1e12 or None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info
