"""The device work runs on when the user names none (the first GPU where there is one, else the CPU), and the free memory
there (a cgroup's limit counted)."""

import math
from pathlib import Path


def default_device() -> str:
    import torch  # here, not at the top: the command line imports this module's users before it needs torch

    return "cuda" if torch.cuda.is_available() else "cpu"


CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_CGROUP_LIMIT = 2**62  # cgroup v1 writes "no limit" as about 2**63, rounded down to a page


def available_bytes(device: str) -> float:
    """Free memory where the run will live: the GPU's (device `cuda:i`), else the host's (MemAvailable, within a
    cgroup's limit where one is set)."""
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable"))
    return float(min(available, _cgroup_free()))


def _cgroup_free(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> float:
    """What this process's memory cgroup still allows: cgroup v2's `memory.max` less `memory.current`, or v1's
    limit (the lowest of the cgroup's and its ancestors', as `memory.stat` gives it) less its usage; infinite where
    none is set. Docker and the shared tools' `memcap.sh` set v1 limits, systemd and newer runtimes v2."""
    try:
        if (root / "memory.max").exists():
            limit, used = (root / "memory.max").read_text().strip(), (root / "memory.current").read_text()
            return math.inf if limit == "max" else int(limit) - int(used)
        path = next(line.split(":", 2)[2] for line in membership.read_text().splitlines() if ":memory:" in line)
        group = root / "memory" / path.strip().lstrip("/")
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        limit = min(
            int((group / "memory.limit_in_bytes").read_text()), int(stat.get("hierarchical_memory_limit", 2**63))
        )
        return math.inf if limit >= NO_CGROUP_LIMIT else limit - int((group / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError, StopIteration):
        return math.inf
