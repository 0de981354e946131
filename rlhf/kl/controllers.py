"""KL-coefficient controllers for the KL in the reward: token_reward_t = score_t - value * kl_t.

`fixed` keeps kl_coef; `adaptive` is the proportional controller of Ziegler et al. 2019 (arXiv:1909.08593),
as in verl and TRL. check_kl_ctrl validates the settings early (the config calls it), build_kl_controller
builds one; each controller's state_dict survives a resume.
"""

import math

KL_CTRL_TYPES = ("fixed", "adaptive")


class FixedKLController:
    """A constant coefficient: `.value` == kl_coef forever. `.value` is all a checkpoint keeps."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)  # checked with the config (check_kl_ctrl), or by build_kl_controller

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_kl_ctrl(type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None) -> None:
    """Validate controller settings without building one (the config calls this early); raises ValueError.

    `fixed` uses only kl_coef (>= 0); `adaptive` also needs target_kl > 0 and horizon > 0.
    """
    if type not in KL_CTRL_TYPES:
        raise ValueError(f"unknown KL controller type {type!r}; valid types: {', '.join(KL_CTRL_TYPES)}")
    if not (_is_number(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if type == "adaptive":
        for setting, value in (("target_kl", target_kl), ("horizon", horizon)):
            if not (_is_number(value) and value > 0):
                raise ValueError(
                    f"{setting} must be a finite number > 0 for the adaptive KL controller, got {value!r}"
                )


class AdaptiveKLController(FixedKLController):
    """Proportional controller of Ziegler et al. 2019 (arXiv:1909.08593), as in verl and TRL: a value that
    `update` moves (its state, a fixed controller's).

    update: e = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon, where n_steps
    is the number of samples (sequences) since the last update and current_kl the measured KL: the trainer
    passes actor/reward_kl_penalty, the sequence mean of whichever estimator algorithm.kl_penalty names.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        check_kl_ctrl("adaptive", init_kl_coef, target_kl, horizon)
        self.value = float(init_kl_coef)
        self.target_kl, self.horizon = float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):  # one NaN would poison the coefficient for the rest of training
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `type` (one of KL_CTRL_TYPES) after check_kl_ctrl."""
    check_kl_ctrl(type, kl_coef, target_kl, horizon)
    if type == "fixed":
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target_kl, horizon)
