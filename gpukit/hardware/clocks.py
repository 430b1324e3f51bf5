"""Why a GPU runs below its maximum clocks: NVML's clocks event (formerly "throttle") reasons, in words.

A table and one function, read by the doctor and the monitor.
"""

from __future__ import annotations

__all__ = ["BENIGN_CLOCK_REASONS", "CLOCK_REASONS", "clock_reasons"]

# Bits of NVML's "clocks event reasons" mask. Values from nvml.h (nvmlClocksEventReason*).
CLOCK_REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake slowdown",
    0x100: "display clock setting",
}
# Reasons that are a choice or a rest state, not a sign the GPU cannot keep up.
BENIGN_CLOCK_REASONS = frozenset({"idle", "application clocks setting", "display clock setting"})


def clock_reasons(mask: int) -> list[str]:
    """NVML's clock-event reasons bit mask in words ("idle", "software power cap", "hardware
    thermal slowdown", …), lowest bit first; bits NVML may add later as "unknown reason 0x…"."""
    names = []
    for bit in range(mask.bit_length()):
        value = 1 << bit
        if mask & value:
            names.append(CLOCK_REASONS.get(value, f"unknown reason 0x{value:x}"))
    return names
