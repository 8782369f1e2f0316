"""The admission latch on active slots (seed 000).

At or above the high-water mark new prefills wait and only decodes run; they resume at or
below the low-water mark. Both thresholds come together or not at all, so an engine cannot
be provisioned with half a policy.
"""

from __future__ import annotations


class LatchConfigError(ValueError):
    pass


class AdmissionLatch:
    def __init__(self, high_water: int | None, low_water: int | None) -> None:
        if (high_water is None) != (low_water is None):
            raise LatchConfigError("--high-water and --low-water go together: give both or neither")
        if high_water is not None and low_water is not None:
            if low_water < 0 or high_water < 1:
                raise LatchConfigError("--low-water must be >= 0 and --high-water >= 1")
            if low_water >= high_water:
                raise LatchConfigError(
                    f"--low-water ({low_water}) must be below --high-water ({high_water})")
        self.high = high_water
        self.low = low_water
        self.gated = False
        self.transitions = 0

    @property
    def enabled(self) -> bool:
        return self.high is not None

    def admits(self, active: int) -> bool:
        """Whether new prefills may be pulled with ``active`` sequences alive."""
        if self.high is None or self.low is None:
            return True
        if not self.gated and active >= self.high:
            self.gated = True
            self.transitions += 1
        elif self.gated and active <= self.low:
            self.gated = False
            self.transitions += 1
        return not self.gated

    def room(self, active: int) -> int | None:
        """How many new sequences fit under the high-water mark (None: unlimited)."""
        if self.high is None:
            return None
        return max(0, self.high - active)
