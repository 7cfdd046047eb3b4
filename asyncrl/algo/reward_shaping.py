"""Length-based reward shaping applied to a response's reward before advantages (pure floats).

- No-EOS penalty (ProRL section 4.2, runs 4 and 5: "we introduce reward shaping by penalizing
  responses that do not terminate correctly", i.e. that never emit EOS before the length limit,
  typically because the model repeats itself). ProRL does not give the formula; asyncrl
  subtracts `penalty` from the reward, or with `replace=True` sets the reward to `-penalty`.
- Soft overlong punishment (DAPO, arXiv:2503.14476, "Overlong Reward Shaping"): with the
  maximum length L_max and a buffer of L_cache tokens before it,

      R_length(y) = 0                                  if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  = -1                                 if L_max < |y|

  added to the correctness reward. asyncrl multiplies it by `penalty_factor` (1 in DAPO).
"""

from __future__ import annotations


def no_eos_penalty(
    reward: float, emitted_eos: bool, penalty: float, replace: bool = False
) -> float:
    """The reward of a response after the ProRL penalty for never emitting EOS."""
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    if emitted_eos:
        return reward
    return -penalty if replace else reward - penalty


def soft_overlong_penalty(
    length: int, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's R_length(|y|) in [-penalty_factor, 0]; `buffer_length` is L_cache."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"need 0 < buffer_length <= max_length, got {buffer_length}, {max_length}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return penalty_factor * (start - length) / buffer_length
    return -penalty_factor


def shaped_reward(
    reward: float,
    length: int,
    emitted_eos: bool,
    *,
    no_eos_penalty_value: float = 0.0,
    max_length: int | None = None,
    overlong_buffer: int | None = None,
    overlong_factor: float = 1.0,
) -> tuple[float, dict[str, float]]:
    """Both shapings (each off by default) and the terms applied, for metrics."""
    shaped = no_eos_penalty(reward, emitted_eos, no_eos_penalty_value)
    overlong = 0.0
    if overlong_buffer is not None:
        if max_length is None:
            raise ValueError("the overlong punishment needs max_length")
        overlong = soft_overlong_penalty(length, max_length, overlong_buffer, overlong_factor)
    return shaped + overlong, {
        "reward/no_eos_penalty": shaped - reward,
        "reward/overlong_penalty": overlong,
    }
