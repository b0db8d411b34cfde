"""Device and system figures for the cost model: ``hardware.DEVICE_CATALOGUE`` plus what planning needs on top.

``hardware.DeviceSpec`` holds the datasheet (peak dense bf16, memory, HBM, TDP, per-device intra/inter-node
bandwidth). Planning also needs devices per node, link latencies, an *achieved* efficiency (the fraction of peak that
a well-tuned training step reaches on its compute, i.e. MFU with no exposed communication and no pipeline bubble), and
the average power as a fraction of TDP. Those live here, keyed by a short name (``h100``, ``mi250x``...), and every
field can be overridden (``get_device("h100", efficiency=0.5)``, ``--efficiency-table FILE``).

MI250/MI250X per *card* (two GCDs as one planning device) come from ``hardware.CARD_CATALOGUE``.

Host floor: small models are bound by the host launching kernels, not by the GPU's arithmetic. An eager block costs
the host ``shape.eager_ops_per_block`` × ``host_op_us`` per micro-batch (forward + backward dispatch; 121 ATen ops
per Llama block, counted on CPU), a compiled block ``host_layer_us_compiled``; ``host_step_us`` is the fixed
per-step part (optimizer, clipping, step agreement). ``host_op_us`` was fitted on the tiny eager run, the one
host-bound run, when a block had more ops than now; it keeps that measured step's prediction at today's op count
and is an assumption until that run is re-measured; the compiled figure and the per-step part are assumptions that
no measured run is bound by (fitted values and their provenance: docs/cost-model.md).

Allocator-visible framework memory: ``blas_workspace_mib``, one cuBLAS/hipBLAS workspace per (thread, stream) —
PyTorch's defaults: 32 MiB on Hopper (sm90) and later, 8.125 MiB (:4096:2:16:8) before, 32 MiB on ROCm (128 MiB on
MI300X, gfx942); the training step holds two (the forward thread and autograd's backward thread).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from anytrain import hardware
from anytrain.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One accelerator as the planner sees it (one PyTorch device; MI250/MI250X: one GCD unless ``-card``)."""

    key: str
    name: str
    peak_bf16_tflops: float
    memory_gib: float
    hbm_tb_per_s: float
    tdp_watts: float
    intra_node_gb_per_s: float  # per device, per direction (NVLink / Infinity Fabric)
    inter_node_gb_per_s: float  # per device share of the node's NICs
    gpus_per_node: int = 8
    efficiency: float = 0.40  # achieved fraction of peak on the compute of a training step (fit on a GPU)
    power_fraction: float = 0.80  # average board power while training / TDP
    intra_latency_us: float = 5.0
    inter_latency_us: float = 15.0
    host_op_us: float = 26.5  # host cost of one eager ATen op (dispatch + autocast + autograd)
    # fitted: docs/cost-model.md
    host_layer_us: float = 0.0  # eager host time per block per micro-batch; 0 = eager_ops_per_block × host_op_us
    host_layer_us_compiled: float = 450.0  # host time per compiled block per micro-batch (assumed)
    host_tp_layer_us: float = 6500.0  # host time per tensor-parallel block per micro-batch, compiled (DTensor
    # hooks, the issue and wait of its sequence-parallel collectives); fitted: docs/cost-model.md
    tp_link_efficiency: float = 0.35  # achieved fraction of intra_node_gb_per_s by the tensor-parallel collectives
    # fitted: docs/cost-model.md
    tp_collective_us: float = 50.0  # GPU time per tensor-parallel collective beyond its bytes (the ranks' kernels
    # waiting for each other: every TP collective sits between two GEMMs, so nothing hides it); fitted:
    # docs/cost-model.md
    host_step_us: float = 2000.0  # per optimizer step: optimizer, clipping, the guard's all-reduce (assumed)
    host_graph_us: float = 60.0  # per micro-batch replayed from a CUDA graph: two input copies + one launch (assumed)
    scan_ns: float = 0.062  # Mamba scan fwd+bwd per (token, inner channel), S=16; fitted: docs/cost-model.md
    ssd_efficiency: float = 0.072  # achieved fraction of peak on the Triton SSD's (Mamba-2) matmul FLOPs, forward
    # + backward, its traffic included; fitted: docs/cost-model.md
    hbm_efficiency: float = 0.85  # achieved fraction of HBM bandwidth by fused elementwise kernels
    # (measured copies: docs/cost-model.md)
    optimizer_bytes_per_param: float = 80.0  # clipping + fused AdamW, in HBM-equivalent bytes per parameter;
    # fitted: docs/cost-model.md
    blas_workspace_mib: float = 32.0  # one cuBLAS/hipBLAS workspace, held per (thread, stream)
    peak_fp8_tflops: float = 0.0  # dense FP8 matmul peak (0: no FP8 matmuls; train.fp8 refused); docs/cost-model.md
    fp8_efficiency: float = 0.0  # achieved fraction of peak_fp8_tflops on FP8 GEMMs; 0 = ``efficiency`` (assumed)

    @property
    def peak_flops(self) -> float:
        return self.peak_bf16_tflops * 1e12

    @property
    def fp8_gemm_efficiency(self) -> float:
        """``fp8_efficiency``, or the bf16 ``efficiency`` when unset (torchao's float8 roofline assumes one achievable
        fraction of peak for both)."""
        return self.fp8_efficiency or self.efficiency

    @property
    def avg_watts(self) -> float:
        return self.tdp_watts * self.power_fraction

    @property
    def vendor(self) -> str:
        """'rocm' for AMD Instinct devices, else 'cuda'."""
        return "rocm" if self.key.startswith("mi") or self.name.upper().startswith(("MI", "AMD")) else "cuda"

    def replace(self, **changes: float | int | str) -> Device:
        known = {f.name for f in dataclasses.fields(self)}
        for name in changes:
            if name not in known:
                raise ConfigError(
                    f"device override {name!r}: unknown field; valid fields are {', '.join(sorted(known))}"
                )
        return dataclasses.replace(self, **changes)


def _from_hw(key: str, catalogue_key: str, **extra: float | int) -> Device:
    spec = dict(hardware.DEVICE_CATALOGUE + hardware.CARD_CATALOGUE)[catalogue_key]
    fields = dataclasses.asdict(spec)
    return Device(key=key, **fields, **extra)


# Achieved-efficiency defaults (fraction of dense bf16 peak on the GEMM/attention arithmetic; the memory-bound part —
# elementwise kernels, GEMM operand traffic, casts, the optimizer — is modelled separately at hbm_efficiency). H200
# fitted (bench/cost_model_validation.py), H100 derived from it (not measured), the others from published MFU, not
# refit with the present memory-bound accounting: sources and figures in docs/cost-model.md. Refit with
# bench/cost_model_validation.py on a GPU. Dense FP8 peaks (peak_fp8_tflops) only where the device has FP8 matmuls
# (Hopper, MI300X); A100, V100 and MI250/MI250X have none (docs/cost-model.md, "FP8").
DEVICES: dict[str, Device] = {
    "h200": _from_hw("h200", "H200", efficiency=0.70, peak_fp8_tflops=1979.0),
    "h100": _from_hw("h100", "H100", efficiency=0.66, peak_fp8_tflops=1979.0),
    "h100-pcie": _from_hw("h100-pcie", "H100 PCIe", efficiency=0.40, gpus_per_node=4, peak_fp8_tflops=1513.0),
    "a100-40": _from_hw("a100-40", "A100-SXM4-40GB", efficiency=0.50, blas_workspace_mib=8.125),
    "a100-80": _from_hw("a100-80", "A100", efficiency=0.50, blas_workspace_mib=8.125),
    "v100": _from_hw("v100", "V100", efficiency=0.40, blas_workspace_mib=8.125),  # fp16 peak: V100 has no bf16
    "mi300x": _from_hw("mi300x", "MI300X", efficiency=0.35, blas_workspace_mib=128.0, peak_fp8_tflops=2614.9),
    "mi250x": _from_hw("mi250x", "MI250X", efficiency=0.38),
    "mi250": _from_hw("mi250", "MI250", efficiency=0.38),
    "mi250x-card": _from_hw("mi250x-card", "MI250X card", gpus_per_node=4, efficiency=0.38),
    "mi250-card": _from_hw("mi250-card", "MI250 card", gpus_per_node=4, efficiency=0.38),
}

ALIASES = {"a100": "a100-80", "h100-sxm": "h100", "h200-sxm": "h200", "mi250x-gcd": "mi250x", "mi250-gcd": "mi250"}

# Named systems: a device plus node figures. Frontier: 4 MI250X (8 GCDs) and 4 x 25 GB/s Slingshot NICs per node.
SYSTEMS: dict[str, tuple[str, dict[str, float | int]]] = {
    "frontier": ("mi250x", {"gpus_per_node": 8, "inter_node_gb_per_s": 12.5}),
    "dgx-h100": ("h100", {"gpus_per_node": 8, "inter_node_gb_per_s": 50.0}),
    "dgx-h200": ("h200", {"gpus_per_node": 8, "inter_node_gb_per_s": 50.0}),
}


def load_efficiency_table(path: str | Path) -> dict[str, dict[str, float]]:
    """JSON ``{"h100": {"efficiency": 0.47, "power_fraction": 0.85}, ...}`` (a validation run writes this)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--efficiency-table: file {path} not found")
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--efficiency-table: {path} is not valid JSON ({exc})") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ConfigError(f"--efficiency-table: {path} must map device keys to objects of field overrides")
    return table


def get_device(kind: str, table: dict[str, dict[str, float]] | None = None, **overrides: float | int) -> Device:
    """Device by short key (``h100``), alias, system name (``frontier``) or a GPU name as torch reports it.

    Overrides apply last: explicit keyword overrides > ``table`` (``anytrain plan --efficiency-table``) > defaults.
    """
    key = kind.strip().lower()
    system_overrides: dict[str, float | int] = {}
    if key in SYSTEMS:
        key, system_overrides = SYSTEMS[key]
    key = ALIASES.get(key, key)
    device = DEVICES.get(key)
    if device is None:  # a full device name such as "NVIDIA H100 80GB HBM3"
        spec = hardware.lookup_spec(kind)
        device = next((d for d in DEVICES.values() if spec and d.name == spec.name), None)
    if device is None:
        choices = ", ".join([*DEVICES, *SYSTEMS])
        raise ConfigError(f"--gpu: unknown device {kind!r}; choose from {choices}")
    merged: dict[str, float | int] = dict(system_overrides)
    if table and device.key in table:
        merged.update(table[device.key])
    merged.update({k: v for k, v in overrides.items() if v is not None})
    return device.replace(**merged) if merged else device


def from_spec(spec: hardware.DeviceSpec | Device | str | None) -> Device | None:
    """Accept what callers have: a hardware.DeviceSpec (from ``hardware.device_spec``), a Device, or a name."""
    if spec is None or isinstance(spec, Device):
        return spec
    if isinstance(spec, str):
        return get_device(spec)
    match = next((d for d in DEVICES.values() if d.name == spec.name), None)
    if match is not None:
        return dataclasses.replace(match, **dataclasses.asdict(spec))
    return Device(key=spec.name.lower(), **dataclasses.asdict(spec))
