"""N simulated GPUs on the CUDA devices of one machine (`tailspec demo --device cuda`, `bench e2e --device cuda`).

With at least as many devices as simulated GPUs, simulated GPU g is device g. With fewer, simulated GPU g is a
share of device g mod count, and its rollout worker and every session lent on it run on that device within that
share:
- **CUDA MPS** where the run can start the MPS control daemon (`nvidia-cuda-mps-control -d`, its pipe and log
  directories under the run directory) and a CUDA client then starts under it: each process of simulated GPU g
  gets `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` = 100 / (GPUs on its device), so its kernels use at most that share of
  the device's SMs, as a GPU of its own would bound them;
- **time-sliced** otherwise: the processes' contexts take turns on the device, each kernel running on every SM.

The RL trainer (the demo process) runs outside MPS on the whole device, as a cluster's update owns every GPU
between rollouts. The run's placement note says which sharing it got and why.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("tailspec.demo")

MPS_CONTROL = "nvidia-cuda-mps-control"
PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
# A CUDA client under the new daemon: it must create a context and run a kernel, or MPS does not hold here.
_PROBE = "import torch; x = torch.ones(8, device='cuda'); torch.cuda.synchronize(); print(float(x.sum()))"


@dataclass
class DeviceShares:
    """Where each simulated GPU runs: `devices[g]` its CUDA device index, `env[g]` what its worker and its sessions
    start with (CUDA_VISIBLE_DEVICES = that device; its MPS share where MPS runs), `sharing` in words."""
    devices: list[int]
    env: list[dict[str, str]]
    sharing: str
    mps: MpsDaemon | None = None

    @property
    def shared(self) -> bool:
        return len(set(self.devices)) < len(self.devices)

    def stop(self) -> None:
        if self.mps is not None:
            self.mps.stop()


def thread_percentage(gpus_on_device: int) -> int:
    """Each of n simulated GPUs' share of a device's SMs under MPS, in percent (at least 1)."""
    if gpus_on_device < 1:
        raise ValueError(f"gpus_on_device must be >= 1, got {gpus_on_device}")
    return max(1, 100 // gpus_on_device)


def assign(workers: int, device_count: int) -> list[int]:
    """Simulated GPU g → CUDA device g mod device_count."""
    if device_count < 1:
        raise ValueError("--device cuda needs a CUDA device; torch sees none")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return [g % device_count for g in range(workers)]


def plan(workers: int, device_count: int, mps: MpsDaemon | None, why_not_mps: str = "") -> DeviceShares:
    """The simulated GPUs' devices and environments. `mps`: a running daemon (devices shared under it), None for
    time-slicing (`why_not_mps` says why) or for one device each."""
    devices = assign(workers, device_count)
    per_device = {d: devices.count(d) for d in set(devices)}
    envs = [{"CUDA_VISIBLE_DEVICES": str(d), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} for d in devices]
    if max(per_device.values()) == 1:
        return DeviceShares(devices, envs, f"{workers} simulated GPUs on {workers} CUDA devices, one each")
    n = max(per_device.values())
    where = f"{workers} simulated GPUs on {len(per_device)} CUDA device{'s' if len(per_device) > 1 else ''}"
    if mps is None:
        return DeviceShares(devices, envs, f"{where}, time-sliced ({why_not_mps or 'MPS not asked for'})")
    for g, d in enumerate(devices):
        envs[g].update({PERCENT_ENV: str(thread_percentage(per_device[d])), PIPE_ENV: str(mps.pipe_dir)})
    return DeviceShares(devices, envs, f"{where}, CUDA MPS {thread_percentage(n)}% of the SMs each", mps)


@dataclass
class MpsDaemon:
    """A private CUDA MPS control daemon: its pipe and log directories under `root`, so it serves this run only."""
    root: Path
    pipe_dir: Path = field(init=False)
    log_dir: Path = field(init=False)
    running: bool = False

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.pipe_dir, self.log_dir = self.root / "mps-pipe", self.root / "mps-log"

    def env(self) -> dict[str, str]:
        return dict(os.environ, **{PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)})

    def start(self, timeout_s: float = 60.0) -> str | None:
        """Start the daemon and check a CUDA client runs under it; None when it does, else why not (and no daemon
        is left running)."""
        exe = shutil.which(MPS_CONTROL)
        if exe is None:
            return f"{MPS_CONTROL} not found"
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            rc = subprocess.run([exe, "-d"], env=self.env(), capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{MPS_CONTROL} -d failed: {e}"
        if rc.returncode != 0:
            return f"{MPS_CONTROL} -d exited {rc.returncode}: {rc.stderr.decode(errors='replace').strip()[:200]}"
        self.running = True
        try:
            probe = subprocess.run([sys.executable, "-c", _PROBE], env=dict(self.env(), **{PERCENT_ENV: "50"}),
                                   capture_output=True, timeout=timeout_s)
            why = None if probe.returncode == 0 else \
                f"a CUDA client failed under MPS: {probe.stderr.decode(errors='replace').strip()[-200:]}"
        except subprocess.TimeoutExpired:
            why = f"a CUDA client did not start under MPS within {timeout_s:g} s"
        if why is not None:
            self.stop()
        return why

    def stop(self) -> None:
        """Quit the daemon (its server ends with it); best effort."""
        if not self.running:
            return
        exe = shutil.which(MPS_CONTROL)
        try:
            if exe is not None:
                subprocess.run([exe], input=b"quit\n", env=self.env(), capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("MPS daemon did not quit: %s", e)
        self.running = False
        shutil.rmtree(self.root, ignore_errors=True)


def share_devices(workers: int, mps: bool = True) -> DeviceShares:
    """Plan the run's simulated GPUs on this machine's CUDA devices, starting MPS where devices are shared and it
    holds (`mps` False: time-sliced)."""
    count = torch.cuda.device_count()
    devices = assign(workers, count)
    if len(set(devices)) == len(devices):
        return plan(workers, count, None)
    if not mps:
        return plan(workers, count, None, "MPS off")
    # the daemon's sockets live under its pipe directory: a short path under /tmp keeps them within a socket
    # path's 108 bytes whatever the run directory is
    daemon = MpsDaemon(Path(tempfile.mkdtemp(prefix="tailspec-mps-")))
    why = daemon.start()
    if why is not None:
        log.warning("simulated GPUs time-slice the device: %s", why)
        return plan(workers, count, None, why)
    return plan(workers, count, daemon)
