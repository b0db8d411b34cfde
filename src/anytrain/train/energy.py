"""Energy measurement during training: a sampler thread reading board power through NVML (``pynvml``, from the
``nvidia-ml-py`` package) on NVIDIA or AMD SMI (``amdsmi``) on AMD, and None values anywhere else (CPU, no library,
no permission). Neither library is a dependency: both are imported lazily and every failure degrades to None.

joules = ∫ P dt (trapezoid over the samples; NVML's total-energy counter is used instead when the GPU has one);
avg_watts = joules / seconds; tokens/J = tokens / joules; TFLOP/s/W = model FLOPs / joules / 1e12.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

PowerReader = Callable[[], float | None]  # watts now, or None
EnergyReader = Callable[[], float | None]  # joules since some origin, or None


def _physical_index(local_index: int) -> int:
    """NVML/AMD SMI enumerate all GPUs; map the process-visible index through CUDA/HIP_VISIBLE_DEVICES."""
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        visible = [v for v in os.environ.get(var, "").split(",") if v.strip()]
        if visible and local_index < len(visible) and visible[local_index].strip().isdigit():
            return int(visible[local_index])
    return local_index


def nvml_readers(index: int) -> tuple[PowerReader, EnergyReader | None] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
        pynvml.nvmlDeviceGetPowerUsage(handle)
    except Exception:  # no library, no driver, no permission: degrade
        return None

    def power() -> float | None:
        try:
            return pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # mW -> W
        except Exception:
            return None

    def energy() -> float | None:
        try:
            return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0  # mJ -> J (Volta and newer)
        except Exception:
            return None

    return power, (energy if energy() is not None else None)


def amdsmi_readers(index: int) -> tuple[PowerReader, EnergyReader | None] | None:
    try:
        import amdsmi

        amdsmi.amdsmi_init()
        handle = amdsmi.amdsmi_get_processor_handles()[_physical_index(index)]
    except Exception:
        return None

    def power() -> float | None:
        try:
            info = amdsmi.amdsmi_get_power_info(handle)
        except Exception:
            return None
        for key in ("current_socket_power", "average_socket_power", "socket_power"):
            value = info.get(key)
            if isinstance(value, (int, float)) and value > 0:
                return float(value)
        return None

    if power() is None:
        return None
    # MI250X reports one socket power per card (two GCDs): the figure is the card's, noted in read()["note"].
    return power, None


class EnergyMeter:
    """Sample one device's power on a daemon thread between start() and stop().

    ``backend``: 'auto' (NVML, then AMD SMI), 'nvml', 'amdsmi', or 'none'; ``power_reader``/``energy_reader``
    inject readers (tests, other sources). read() -> {avg_watts, joules, seconds, samples, backend}, with None
    for avg_watts and joules when no reader is available.
    """

    def __init__(
        self,
        device_index: int = 0,
        interval_s: float = 0.1,
        backend: str = "auto",
        power_reader: PowerReader | None = None,
        energy_reader: EnergyReader | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.backend = "custom" if power_reader else "none"
        self._power, self._energy = power_reader, energy_reader
        if power_reader is None and backend != "none":
            for name, factory in (("nvml", nvml_readers), ("amdsmi", amdsmi_readers)):
                if backend in ("auto", name):
                    readers = factory(device_index)
                    if readers:
                        self._power, self._energy = readers
                        self.backend = name
                        break
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset()

    @property
    def available(self) -> bool:
        return self._power is not None

    def _reset(self) -> None:
        self._joules = 0.0
        self._samples = 0
        self._last: tuple[float, float] | None = None
        self._first_t: float | None = None
        self._t0 = self._t1 = time.perf_counter()
        self._e0 = self._e1 = None

    def _sample(self) -> None:
        watts = self._power() if self._power else None
        now = time.perf_counter()
        with self._lock:
            if watts is not None:
                if self._last is not None:
                    t_prev, w_prev = self._last
                    self._joules += 0.5 * (w_prev + watts) * (now - t_prev)
                else:
                    self._first_t = now
                self._last = (now, watts)
                self._samples += 1
            self._t1 = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> EnergyMeter:
        """Begin a measurement window (resets the totals)."""
        self.stop()
        self._reset()
        self._stop.clear()
        if self._energy:
            self._e0 = self._energy()
        self._sample()
        if self.available:
            self._thread = threading.Thread(target=self._run, name="anytrain-energy", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict:
        """End the window (idempotent) and return read()."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(1.0, 5 * self.interval_s))
            self._thread = None
            self._sample()
            if self._energy:
                self._e1 = self._energy()
        return self.read()

    def read(self) -> dict:
        """Totals so far: avg_watts and joules (None without a power reader), seconds, samples, backend."""
        if self._thread is not None:
            self._sample()
        with self._lock:
            seconds = max(self._t1 - self._t0, 0.0)
            avg: float | None = None
            if self._last is not None and self._first_t is not None and self._last[0] > self._first_t:
                avg = self._joules / (self._last[0] - self._first_t)  # mean power over the sampled span
            elif self._last is not None:
                avg = self._last[1]
            joules = avg * seconds if avg is not None and self._samples >= 2 else None
            end = self._e1 if self._thread is None else (self._energy() if self._energy else None)
            if self._e0 is not None and end is not None and end >= self._e0:
                joules = end - self._e0  # the hardware counter beats sampling
                avg = joules / seconds if seconds > 0 else avg
            return {
                "avg_watts": avg,
                "joules": joules,
                "seconds": seconds,
                "samples": self._samples,
                "backend": self.backend,
            }

    def __enter__(self) -> EnergyMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def energy_metrics(joules: float | None, seconds: float, tokens: float, flops: float, devices: int = 1) -> dict:
    """Metrics for the trainer's log: avg_watts (per device), joules (all devices), tokens_per_joule, tflops_per_watt.

    ``joules`` is one device's; ``devices`` scales it to the job (each rank measures its own device; summing across
    ranks is exact, scaling is the rank-0 approximation). ``tokens`` and ``flops`` are the job's totals."""
    if joules is None or joules <= 0 or seconds <= 0:
        return {"avg_watts": None, "joules": None, "tokens_per_joule": None, "tflops_per_watt": None}
    total = joules * devices
    return {
        "avg_watts": joules / seconds,
        "joules": total,
        "tokens_per_joule": tokens / total,
        "tflops_per_watt": flops / total / 1e12,
    }
