"""Rotary position embeddings as transformers computes them: default, `linear`, `llama3` and `yarn` frequencies,
YaRN's attention scale, the `rotate_half` convention (so Hugging Face weights load with no permutation)."""

from __future__ import annotations

import math

import torch

from tasks.config.model import ModelConfig


def inv_freq(m: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """Rotary inverse frequencies in fp32, exactly as transformers' default, `linear` and `llama3` rope inits
    compute them.

    `theta`: another base without scaling (Gemma's sliding layers); None = m.rope_theta with m.rope_scaling.
    """
    dim = m.head_dim
    freq = 1.0 / ((theta or m.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = m.rope_scaling
    if rs is None or theta is not None:
        return freq
    if rs.rope_type == "linear":
        return freq / rs.factor
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(m, m.rope_theta)
    assert rs.original_max_position_embeddings and rs.low_freq_factor and rs.high_freq_factor  # llama3's bands
    old_len = rs.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / rs.low_freq_factor, old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / rs.factor, freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(m: ModelConfig, base: float) -> torch.Tensor:
    """YaRN frequencies as transformers' `_compute_yarn_parameters`: extrapolated (unscaled) above the
    `beta_fast` rotations over the pretraining context, interpolated (/ factor) below `beta_slow`, a linear
    ramp between (the correction range truncated to whole dimensions)."""
    rs, dim = m.rope_scaling, m.head_dim
    assert rs is not None and rs.original_max_position_embeddings is not None

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast or 32)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow or 1)), dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high)
                                                                             - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (rs.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_attention_scale(m: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by: YaRN's attention_factor (null: 0.1 ln(factor) + 1),
    else 1."""
    rs = m.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    return 0.1 * math.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
