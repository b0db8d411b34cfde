"""Cost model and planner: predict memory, communication, time and energy of a training run before it starts.

``shapes`` holds the inputs (model shape, precision preset, layout, workload), ``memory`` the per-device memory
accounting (validated against measured allocator peaks and the tensors autograd saves), ``model`` the communication,
time and energy arithmetic and ``estimate`` (re-exporting the other two; closed forms in each docstring and in
docs/cost-model.md), ``devices`` the device and system figures (hardware.DEVICE_CATALOGUE plus efficiency, power,
host and node data), ``planner`` the layout search and job sizing, ``tables`` their answers as text and ``cli`` the
``anytrain plan`` verb (options only). The projection tables of docs/cost-model.md are ``bench/cost_projection.py``.
"""

from anytrain.cost.devices import DEVICES, SYSTEMS, Device, get_device
from anytrain.cost.model import (
    AMP,
    FSDP_BF16,
    MEGATRON,
    Estimate,
    Layout,
    MambaShape,
    ModelShape,
    Precision,
    Workload,
    estimate,
    memory_per_device,
    memory_phases,
)
from anytrain.cost.planner import NoFeasiblePlan, PlanResult, choose_layout, plan

__all__ = [
    "AMP",
    "DEVICES",
    "FSDP_BF16",
    "MEGATRON",
    "SYSTEMS",
    "Device",
    "Estimate",
    "Layout",
    "MambaShape",
    "ModelShape",
    "NoFeasiblePlan",
    "PlanResult",
    "Precision",
    "Workload",
    "choose_layout",
    "estimate",
    "get_device",
    "memory_per_device",
    "memory_phases",
    "plan",
]
