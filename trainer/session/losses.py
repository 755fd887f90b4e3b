"""The losses a training session's forward_backward takes, Tinker's, each summed over tokens as Tinker's are: of
the target tokens' log-probabilities `lp` under the adapter, the datums' inputs (schemas.sessions.Datum) and the
loss's settings (schemas.sessions.LOSS_CONFIG: loss_fn_config, or a per-token input of the same name).

  cross_entropy         -sum w * lp                                    (w: weights, else every live token)
  importance_sampling   -sum r * A                                     (r = exp(lp - q), q the sampler's logprobs)
  ppo                   -sum min(r * A, clip(r, lo, hi) * A)
  cispo                 -sum sg(clip(r, lo, hi)) * lp * A
  dro                   -sum lp * A - beta/2 * (lp - q)^2 * m          (m: the sampled tokens)
  gspo                  -sum min(s * A, clip(s, lo, hi) * A)            s = sg(g) * exp(lp - sg(lp)): GSPO-token,
                        g = exp(mean over the datum's sequence_ratio_mask (else its tokens with an advantage) of
                        lp - q), the sequence's ratio, length-normalised (Zheng et al. 2025)
  stable_reinforce      -sum_S sg(min(R, cap)) * lp * A + kl/2 * sum_S (lp - Q)^2, over the sampled tokens S named
                        by the datum's provenance, Q the log-probabilities the sampler recorded for them (the
                        stability info: never the client's copy), R = exp(lp - Q) truncated at cap
                        (clip_high_threshold) and kl = kl_coeff"""

from __future__ import annotations

import torch

from schemas.sessions import LOSS_CONFIG, RECORDED_LOGPROBS, SAMPLED_MASK, Datum, ForwardBackward


def column(data: list[Datum], name: str, width: int, device: str, dtype=torch.float32) -> torch.Tensor:
    """Input `name` of each datum as one right-padded [rows, width] tensor (0 where a datum has none)."""
    out = torch.zeros(len(data), width, dtype=dtype)
    for row, d in enumerate(data):
        values = d.inputs.get(name)
        if values is not None:
            out[row, : len(values)] = torch.tensor(values, dtype=dtype)
    return out.to(device)


class Inputs:
    """A batch's inputs as tensors the width of its log-probs, made when first asked for."""

    def __init__(self, fb: ForwardBackward, lp: torch.Tensor, mask: torch.Tensor) -> None:
        self.fb, self.data, self.width, self.device = fb, fb.data, lp.shape[1], str(lp.device)
        self.live = mask.float()

    def __call__(self, name: str) -> torch.Tensor:
        return column(self.data, name, self.width, self.device)

    def has(self, name: str) -> bool:
        return all(name in d.inputs for d in self.data)

    def setting(self, name: str) -> torch.Tensor:
        """A per-token input of that name where every datum has one, else loss_fn_config's (else the default)."""
        if self.has(name):
            return self(name)
        return torch.tensor(float(self.fb.config.get(name, LOSS_CONFIG[self.fb.loss_fn][name])), device=self.device)


def loss_of(fb: ForwardBackward, lp: torch.Tensor, data: list[Datum], mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The batch's loss, summed over tokens as Tinker's losses are, and how many tokens carry weight."""
    x = Inputs(ForwardBackward(data=data, loss_fn=fb.loss_fn, config=fb.config), lp, mask)
    if fb.loss_fn == "cross_entropy":
        weights = (x("weights") if x.has("weights") else x.live) * x.live
        return -(lp * weights).sum(), int((weights != 0).sum())
    advantages = x("advantages") * x.live
    weighed = int((advantages != 0).sum())
    if fb.loss_fn == "stable_reinforce":
        return _stable_reinforce(x, lp, advantages), weighed
    sampled = x("logprobs")
    ratio = torch.exp(lp - sampled)
    if fb.loss_fn == "importance_sampling":
        return -(ratio * advantages).sum(), weighed
    if fb.loss_fn == "dro":  # a quadratic penalty on the log-ratio keeps the update near the sampler, on the
        beta = x.setting("beta")  # sampled tokens (those with weights, else an advantage)
        taken = x("weights") if x.has("weights") else (advantages != 0).float()
        return -(lp * advantages - 0.5 * beta * (lp - sampled).square() * taken * x.live).sum(), weighed
    low, high = x.setting("clip_low_threshold"), x.setting("clip_high_threshold")
    if fb.loss_fn == "gspo":
        ratio = _sequence_ratio(x, lp, sampled, advantages)
    clipped = torch.clamp(ratio, low, high)
    if fb.loss_fn == "cispo":  # the clipped ratio weighs the log-probability's gradient, itself without one
        return -(clipped.detach() * lp * advantages).sum(), weighed
    return -torch.minimum(ratio * advantages, clipped * advantages).sum(), weighed  # ppo, gspo


def _sequence_ratio(x: Inputs, lp: torch.Tensor, sampled: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """GSPO-token's ratio at each token: the sequence's length-normalised ratio (no gradient of its own) times
    exp(lp - sg(lp)), whose value is 1 and whose gradient is lp's."""
    over = x("sequence_ratio_mask") if x.has("sequence_ratio_mask") else (advantages != 0).float()
    over = over * x.live
    mean_log_ratio = ((lp - sampled) * over).sum(dim=1, keepdim=True) / over.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.exp(mean_log_ratio.detach() + lp - lp.detach())


def _stable_reinforce(x: Inputs, lp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    taken = x(SAMPLED_MASK) * x.live
    recorded = x(RECORDED_LOGPROBS)
    cap, kl = x.setting("clip_high_threshold"), x.setting("kl_coeff")
    weight = torch.minimum(torch.exp(lp - recorded), cap).detach()
    return -(weight * lp * advantages * taken).sum() + 0.5 * kl * ((lp - recorded).square() * taken).sum()
