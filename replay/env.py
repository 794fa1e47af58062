"""The environment a replay ran in, recorded with every run (host, CPU, GPU, driver, versions)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver() -> str | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": ", ".join(gpus) if gpus else None,
        "gpu_count": len(gpus),
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "pandas": _version("pandas"),
        "pyarrow": _version("pyarrow"),
        "hydra": _version("hydra-core"),
        "mlflow": _version("mlflow"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    }
