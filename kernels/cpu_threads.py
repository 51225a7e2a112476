"""How many threads the CPU kernels use, and the rule for the default.

The native kernels run on their own pool (kernels/cpu_pool.c: items claimed one at a time,
idle workers asleep after 10 us). torch's intra-op team gets the same count but must not spin
while waiting: hetero sets OMP_WAIT_POLICY=PASSIVE before it loads torch (hetero/__init__.py);
where torch was loaded first with a spinning team, the team is kept at one thread instead
(`hetero generate`, whose attention is torch's, went from 0.4 to 40 tok/s with 2 threads on 2
busy cores).

The default is the physical cores this process may run on (the affinity mask; SMT siblings
share one core's multipliers, and a decode step is bound by memory bandwidth, which extra
threads on a busy core do not add), less one where there are 4 or more: the server process
(HTTP, tokenizer) and the pipeline's other stages need a core to answer while the engine
computes. A core some other job holds costs a share of the throughput, never a collapse: the
pool's other threads take the items of a descheduled one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
_threads: int | None = None  # set by configure()


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None) -> int:
    """Distinct physical cores among `cpus` (default: the ones this process may use), from the
    kernel's topology files; the CPU count where they cannot be read."""
    cpus = _allowed_cpus() if cpus is None else cpus
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def default_threads(stages: int = 1) -> int:
    """Threads for one of `stages` CPU processes sharing the machine (pipeline stages on the
    CPU): the physical cores, one left to the server where there are 4 or more, split evenly."""
    cores = physical_cores()
    spare = 1 if cores >= 4 else 0
    return max(1, (cores - spare) // max(1, stages))


def configure(threads: int = 0, stages: int = 1) -> int:
    """Set the kernels' and torch's thread count (0: the default) and return it."""
    import torch

    import hetero

    global _threads
    n = threads if threads > 0 else default_threads(stages)
    _threads = n
    torch.set_num_threads(n if hetero.TORCH_OMP_PASSIVE else 1)
    why = "--threads" if threads > 0 else f"default: {physical_cores()} physical cores"
    log.info("CPU threads: %d (%s)", n, why)
    return n


def get() -> int:
    """The thread count the kernels run with: configure()'s, else torch's (a caller that only
    sets torch's threads, a test or a benchmark, sets the kernels' too)."""
    import torch

    return _threads if _threads is not None else torch.get_num_threads()


def planned() -> int:
    """The thread count the kernels run with once configured: configure()'s, else the default
    it would choose. Stable across a process's configure() calls with no --threads (the
    profile's cache key: torch's own count changes when configure() sets it)."""
    return _threads if _threads is not None else default_threads()


def ensure() -> int:
    """configure() with the default where nothing configured the threads yet; the count."""
    return _threads if _threads is not None else configure()


def describe() -> str:
    """One line for the start log: threads and the kernels' instruction set."""
    from hetero.kernels import cpu_qdot

    isa = cpu_qdot.isa() if cpu_qdot.available() else "none (no C compiler)"
    return f"CPU: {get()} threads of {physical_cores()} physical cores; qdot kernels {isa}"
