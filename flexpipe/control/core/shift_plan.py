"""A shift's rehearsal probe (pure; docs/controller.md, "A shift, make-before-break"): its
size and its verdict. The live probe goes over HTTP, the simulator's runs on a copy of the
engine core; both ask these. The step order (`plan_shift`) is the shift policy's, in
`flexpipe.policies.shift.step_order`.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "MAX_PROBE_TOKENS",
    "MIN_PROBE_TOKENS",
    "PROBE_MIN_OVERHEADS",
    "probe_tokens",
    "rehearsal_check",
]

MIN_PROBE_TOKENS = 16
MAX_PROBE_TOKENS = 256
PROBE_MIN_OVERHEADS = 10.0  # the probe's predicted wall time over the HTTP allowance


def probe_tokens(ttft_s: float, tpot_s: float, time_scale: float, overhead_s: float) -> int:
    """Tokens a rehearsal probe asks for: at least 16, and enough that its predicted time
    (`ttft_s` + `tpot_s` per further token, in modelled seconds) is `PROBE_MIN_OVERHEADS`
    times the HTTP allowance `overhead_s` of wall time at `time_scale` (at most 256). With a
    fixed 16 tokens, a sim engine at time scale 0.05 answered in ~30 ms of wall time, less than
    a 50 ms allowance: the measured time was clamped to 0 and every rehearsal passed."""
    if time_scale <= 0 or tpot_s <= 0:
        return MIN_PROBE_TOKENS
    want_s = PROBE_MIN_OVERHEADS * overhead_s / time_scale  # modelled
    n = math.ceil((want_s - ttft_s) / tpot_s) + 1
    return max(MIN_PROBE_TOKENS, min(MAX_PROBE_TOKENS, n))


def rehearsal_check(
    key: str, measured_s: float, predicted_s: float, tolerance: float
) -> dict[str, Any]:
    """A rehearsal's verdict, as the outcome and the shift log record it: the probe's time
    against the gear table's prediction for it; passed within `tolerance` times."""
    ratio = measured_s / predicted_s if predicted_s > 0 else 1.0
    passed = ratio <= tolerance
    why = (
        ""
        if passed
        else (
            f"{key}: probe took {measured_s:.3f} s against {predicted_s:.3f} s "
            f"predicted (x{ratio:.2f}, tolerance x{tolerance:g})"
        )
    )
    return {
        "instance": key,
        "passed": passed,
        "why": why,
        "predicted_s": round(predicted_s, 4),
        "measured_s": round(measured_s, 4),
        "ratio": round(ratio, 3),
    }
