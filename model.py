"""The Nash-MHC transformer: mHC residual streams (Sinkhorn) around causal multi-scale attention
fused per token by a Nash equilibrium. Plain nn.Modules; see DESIGN.md section 1 for the maths.

Shapes: B batch, T tokens, C d_model, n mHC streams, L attention scales, H query heads,
Hkv key/value heads, G = H // Hkv queries per key/value head, D head_dim.

    python model.py CONFIG.yaml      # summary of the config's `model:` section, built on the meta device

XLA notes: every mask comes from `arange` comparisons, every loop has a static trip count, no
`.item()` and no Python branch on tensor values; the only branches are on config values and shapes.
Nothing here imports torch_xla.

Four small autograd.Functions (the Sinkhorn iterations, the normalised projection that gives the
mHC coefficients, and the stream read and write) spell out their backward: the same maths with
fewer passes over, and fewer temporaries of, the n-times wider residual. Each is gradchecked.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import hashlib
import itertools
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.autograd.function import once_differentiable

MHC_RES_OFF_DIAG_BIAS = -8.0            # H_res starts at ~identity: exp(-8) = 3e-4 off the diagonal
MHC_PRE_BIAS = 2.0                      # H_pre starts at sigmoid(+-2) = 0.88 / 0.12: one favoured stream
                                        # per sub-layer (all streams are equal at the start anyway)
MHC_GATE_INIT = 0.01                    # the gates alpha
STREAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _help(text: str, default):
    return field(default=default, metadata={"help": text})


@dataclass
class ModelConfig:
    """The YAML `model:` section. Defaults: the tiny demo model (configs/demo.yaml)."""
    vocab_size: int = _help("vocabulary size (at least the tokenizer's)", 512)
    d_model: int = _help("model width C", 128)
    n_layers: int = _help("number of blocks", 4)
    n_heads: int = _help("query heads (head_dim = d_model / n_heads, even)", 4)
    n_kv_heads: int = _help("key/value heads (grouped-query attention; divides n_heads)", 2)
    max_seq_len: int = _help("longest sequence; a multiple of nash_compression**(nash_scales-1)", 256)
    ffn_mult: float = _help("SwiGLU hidden = ffn_mult * d_model rounded up to a multiple of ffn_multiple_of",
                            2.67)
    ffn_multiple_of: int = _help("the SwiGLU hidden size is a multiple of this", 32)
    rope_theta: float = _help("rotary embedding base", 10000.0)
    norm_eps: float = _help("RMSNorm epsilon", 1e-5)
    tie_embeddings: bool = _help("share the token embedding with the LM head", True)
    dropout: float = _help("dropout on the embedding and on every sub-layer output", 0.0)
    init_std: float = _help("std of the weight init (output projections: init_std / sqrt(2 n_layers))", 0.02)
    mhc_streams: int = _help("mHC residual streams n (1: plain residual)", 4)
    sinkhorn_iters: int = _help("Sinkhorn-Knopp iterations for H_res (mhc_lite false)", 20)
    mhc_lite: bool = _help("H_res as a softmax-weighted convex combination of the n! permutation matrices "
                           "(mHC-lite: doubly stochastic by construction, no iterations, cheaper on every "
                           "backend); false: Sinkhorn-Knopp, as in DeepSeek's mHC", True)
    stream_dtype: Literal["fp32", "bf16"] = _help(
        "dtype of the mHC residual streams between sub-layers (mhc_streams > 1; bf16 halves their "
        "memory traffic, as in the mHC paper); the mixing and its coefficients are computed in fp32", "fp32")
    nash_scales: int = _help("attention scales L (1: plain causal attention)", 3)
    nash_compression: int = _help("compression ratio r: scale l pools blocks of r**l tokens", 4)
    nash_window: int = _help("sliding window of the full-resolution scale (0: none)", 64)
    nash_iters: int = _help("best-response rounds of the Nash aggregation", 3)
    nash_tau: float = _help("initial temperature of the Nash best response (learned, per head), in [0.001, 1000]", 1.0)
    nash_pool: Literal["mean", "learned"] = _help("how a block of keys/values is compressed", "mean")
    aggregation: Literal["nash", "convex", "mean"] = _help("how the scale outputs are fused", "nash")
    activation_checkpointing: bool = _help("recompute each block in the backward pass", False)
    loss_chunk: int = _help("sequence positions per cross-entropy chunk (0: all at once): the logits are "
                            "made [batch, loss_chunk, vocab] at a time, dropped, and recomputed in the "
                            "backward pass (+1/3 of the LM head's FLOPs); forward returns no logits with "
                            "targets", 0)

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(f.name, getattr(self, f.name), hints[f.name]))

        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len",
                     "ffn_multiple_of", "mhc_streams", "sinkhorn_iters", "nash_scales", "nash_iters"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be at least 1")
        for name in ("ffn_mult", "rope_theta", "norm_eps", "init_std", "nash_tau"):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")
        # the best response is a softmax of payoffs / tau: far outside this range its logits (or
        # their gradients) overflow in the first step, which then reads as a NaN loss
        need(1e-3 <= self.nash_tau <= 1e3, f"nash_tau={self.nash_tau} must be in [0.001, 1000]")
        need(self.d_model % self.n_heads == 0,
             f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        need(self.head_dim % 2 == 0,
             f"d_model={self.d_model} gives head_dim={self.head_dim}, which must be even for rotary embeddings")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")
        need(0.0 <= self.dropout < 1.0, f"dropout={self.dropout} must be in [0, 1)")
        need(not self.mhc_lite or self.mhc_streams <= 6,
             f"mhc_lite=true needs mhc_streams <= 6 (it mixes all n! permutations; mhc_lite: false uses "
             f"Sinkhorn), got {self.mhc_streams}")
        need(self.nash_compression >= 2, f"nash_compression={self.nash_compression} must be at least 2")
        need(self.nash_window >= 0, f"nash_window={self.nash_window} must be 0 (no window) or positive")
        need(self.loss_chunk >= 0, f"loss_chunk={self.loss_chunk} must be 0 (no chunks) or positive")
        need(self.max_seq_len % self.coarsest_block == 0,
             f"max_seq_len={self.max_seq_len} is not a multiple of the coarsest block "
             f"nash_compression**(nash_scales-1)={self.coarsest_block}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """ffn_mult * d_model rounded up to a multiple of ffn_multiple_of (2.67 * 128 -> 352 with 32)."""
        m = self.ffn_multiple_of
        return m * math.ceil(round(self.ffn_mult * self.d_model, 6) / m)

    @property
    def coarsest_block(self) -> int:
        """Tokens per compressed block at the coarsest scale; sequences are padded to a multiple of it."""
        return self.nash_compression ** (self.nash_scales - 1)

    @classmethod
    def from_dict(cls, d) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError(f"model: expected a mapping of fields, got {d!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else f"; valid fields: {', '.join(names)}"
                raise ValueError(f"{key}: unknown model field{hint}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _checked(name: str, value, tp):
    """``value`` in the type ``tp`` of the field, or a ValueError naming the field."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    choices = typing.get_args(tp)  # Literal
    if value in choices:
        return value
    spelled = {str(c).lower(): c for c in choices}  # case-blind: Nash is one key from nash
    close = difflib.get_close_matches(str(value).lower(), list(spelled), n=1)
    hint = f" (did you mean '{spelled[close[0]]}'?)" if close else ""
    raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}{hint}")


@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor]       # [B, T, vocab]; None when the loss was computed in chunks
    loss: Optional[torch.Tensor]         # mean cross-entropy over targets != -1, or None
    metrics: dict[str, torch.Tensor]     # detached scalars


# ----------------------------------------------------------------------------------------------
# Sinkhorn-Knopp and the Nash equilibrium: the two pieces of maths, as plain functions.

def sinkhorn_knopp(logits: torch.Tensor, iters: int = 20, eps: float = 1e-6, iterate=None) -> torch.Tensor:
    """Doubly-stochastic matrices from logits ``[..., n, n]``, in fp32 whatever the input dtype.

    Start from the positive matrix ``softmax(logits) + eps`` (row-wise softmax: finite for ±1e4
    logits; the ``+eps`` keeps every column sum away from 0, otherwise the backward pass multiplies
    by 1/eps at every iteration and overflows), then ``iters`` rounds of row and column
    normalisation, each division with ``+eps``. Sinkhorn converges slowly when the matrix is close
    to having no perfect-matching support (saturated logits do that), so a closing step makes the
    result exact: the orthogonal projection onto {rows and columns sum to 1} (it adds
    ``(1-r_i)/n + (1-c_j)/n - (n-S)/n^2``, a no-op once the iterations converged), then, only if
    that made an entry negative, the smallest mix with the uniform matrix J/n that is non-negative.

    ``iterate(p, iters, eps)`` runs the iterations (default: ``_SinkhornIterations``); a backend
    may give the same maths in another form (the XLA backend: one compiled loop, not 2 x iters
    unrolled steps and their backward).
    """
    with torch.autocast(device_type=logits.device.type, enabled=False):
        shape, n = logits.shape, logits.shape[-1]
        # matrices last -> first: every op below then runs on long contiguous vectors (10x on CPU)
        z = logits.float().reshape(-1, n, n).permute(1, 2, 0).contiguous()      # [n, n, N]
        p = torch.softmax(z, dim=1) + eps  # rows: dim 1
        if iters > 0:
            p = iterate(p, iters, eps) if iterate is not None else _SinkhornIterations.apply(p, iters, eps)
        # the projection: with row and column sums r, c and total S = sum(r), it adds
        # (1-r_i)/n + (1-c_j)/n - (n-S)/n^2 = (1 + S/n - r_i - c_j) / n
        r, c = p.sum(dim=1, keepdim=True), p.sum(dim=0, keepdim=True)        # [n, 1, N], [1, n, N]
        p = p + (1.0 + r.sum(dim=0, keepdim=True) / n - r - c) / n
        # the mix: lam = max_ij neg/(neg + 1/n) with neg = max(-p, 0), which is increasing in neg,
        # so it is taken at the smallest entry (one reduction, the rest on [1, 1, N]); then
        # (1 - lam) p + lam/n = (p + neg) / (1 + n neg), where p + neg >= 0 holds exactly in
        # floating point (p_ij - min(p) >= 0: rounding is monotone), so no clamp is needed
        neg = (-p.amin(dim=(0, 1), keepdim=True)).clamp_min(0.0)
        p = (p + neg) / (1.0 + n * neg)
        return p.permute(2, 0, 1).reshape(shape).contiguous()


class _SinkhornIterations(torch.autograd.Function):
    """``iters`` rounds of row then column normalisation of a positive ``p [n, n, N]`` (rows: dim 1).

    The plain loop's maths with the backward written out: autograd would keep all 2 * iters
    iterates and record three times the kernels. For a step ``q = p / s`` with ``s = sum(p) + eps``
    over the normalised dim, the input gradient is ``(g - sum(g * q)) / s``. Only the output and
    the normalisers ``s`` are saved; the backward walks the steps in reverse and undoes each
    division (``p = q * s``) to recover that step's ``q``.
    """

    @staticmethod
    def forward(ctx, p, iters: int, eps: float):
        p = p.clone()
        norms = []
        for _ in range(iters):
            for dim in (1, 0):
                s = p.sum(dim=dim, keepdim=True).add_(eps)
                p.div_(s)
                norms.append(s)
        ctx.save_for_backward(p, *norms)
        return p

    @staticmethod
    @once_differentiable  # it reuses saved normalisers in place: a second derivative would be wrong
    def backward(ctx, g):
        q, *norms = ctx.saved_tensors
        q, g = q.clone(), g.clone()
        for step in reversed(range(len(norms))):
            dim, s = (1, 0)[step % 2], norms[step]
            g.sub_((g * q).sum(dim=dim, keepdim=True)).div_(s)
            q.mul_(s)
        return g, None, None


def scale_gram(outs) -> torch.Tensor:
    """``G [..., L, L]``, ``G_lm = mean_d(o_l o_m)``, of the scale outputs: a list of L tensors
    ``[..., D]``, pair by pair (in eager PyTorch on CPU 4x faster than a batch of tiny
    ``[L, D] @ [D, L]`` products), or one ``[..., L, D]`` (for XLA: one broadcast product and one
    reduction in its graph instead of L (L + 1) / 2 of each; element-wise, not a batch of
    products, whose batch would merge the token and head dimensions and make GSPMD gather the
    heads split over tp)."""
    if isinstance(outs, torch.Tensor):
        return (outs.unsqueeze(-2) * outs.unsqueeze(-3)).sum(dim=-1) / outs.shape[-1]
    return torch.stack([torch.stack(row, dim=-1) for row in scale_gram_pairs(outs)], dim=-2)


def scale_gram_pairs(outs: list) -> list:
    """``scale_gram`` of a list of L scale outputs ``[..., D]`` as an L x L nested list of ``[...]``
    tensors (each pair computed once), for ``nash_rounds_by_scale``."""
    L, D = len(outs), outs[0].shape[-1]
    g = [[None] * L for _ in range(L)]
    for l in range(L):
        for m in range(l, L):
            g[l][m] = g[m][l] = (outs[l] * outs[m]).sum(dim=-1) / D
    return g


def nash_distances(gram: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Every scale's mean squared distance to the consensus ``c = sum_m w_m o_m``, from the Gram
    matrix ``[..., L, L]``: ``|o_l - c|^2 / D = G_ll - 2 (G w)_l + w^T G w``, O(L^2) per token.

    The three terms are as large as ``|o_l|^2`` while their sum can be 0 (a scale on the
    consensus), so rounding can take it below 0 by a few ulps of ``max G_ll``; a distance is
    never negative, so it is clamped at 0. (The rounds below need only the differences between
    scales, not the distances themselves; this is the quantity itself, for analysis and tests.)
    """
    gw = (gram * w.unsqueeze(-2)).sum(dim=-1)                                       # (G w)_l
    return (gram.diagonal(dim1=-2, dim2=-1) - 2.0 * gw + (w * gw).sum(dim=-1, keepdim=True)).clamp_min(0.0)


def nash_start(valid: torch.Tensor, dtype=torch.float32):
    """The rounds' starting point from the scales' validity ``valid [..., L]`` (bool, at least one
    True per row): uniform weights over the valid scales, and the additive mask that keeps the
    invalid ones at weight exactly 0 (0 valid, -inf invalid), in ``dtype``."""
    valid_f = valid.to(dtype)
    return valid_f / valid_f.sum(dim=-1, keepdim=True), _bias(valid).to(dtype)


def nash_rounds(gram: torch.Tensor, start: torch.Tensor, hidden: torch.Tensor, tau, iters: int) -> torch.Tensor:
    """The best-response rounds of ``nash_equilibrium`` on the scales' Gram matrix ``[..., L, L]``
    from ``nash_start``'s weights and mask (a round costs O(L^2) per token, whatever the head size).

    A scale's mean squared distance to the consensus ``c = sum_m w_m o_m`` is
    ``|o_l - c|^2 / D = G_ll - 2 (G w)_l + w^T G w``. The last term is the same for every scale,
    and a softmax does not see a shift shared by all its entries, so a round is
    ``w = softmax((2 (G w)_l - G_ll) / tau)`` over the valid scales: the same weights without the
    shared term. No distance is formed, so none can come out negative by cancellation (the clamp
    that ``nash_distances`` needs has nothing to do here). What does not change between rounds
    (``2 / tau``, ``hidden - G_ll / tau``) is computed once; ``G w`` is a broadcast product and a
    sum over the last dim (element-wise work over the tokens and heads, as ``scale_gram``).
    """
    gain = 2.0 / tau
    base = hidden.to(gram.dtype) - gram.diagonal(dim1=-2, dim2=-1) / tau
    w = start.to(gram.dtype)
    for _ in range(iters):
        w = torch.softmax((gram * w.unsqueeze(-2)).sum(dim=-1) * gain + base, dim=-1)   # (G w)_l
    return w


def nash_rounds_by_scale(gram: list, start: torch.Tensor, hidden: torch.Tensor, tau, iters: int) -> torch.Tensor:
    """``nash_rounds`` with each scale's numbers in a tensor of their own: ``gram`` is
    ``scale_gram_pairs``' L x L nested list of ``[...]`` tensors, and a round's L logits are stacked
    in front (``[L, ...]``), so its products and its softmax run over contiguous tokens instead of
    rows of L (3) numbers: eager CPU, the rounds' forward and backward at issue 13's shape
    26 -> 19 ms per layer. The same weights ``[..., L]``, up to rounding."""
    L = len(gram)
    gain = 2.0 / tau
    base = torch.stack([hidden[..., l].to(gram[l][l].dtype) - gram[l][l] / tau for l in range(L)])
    w = start.to(base.dtype).unbind(dim=-1)
    for _ in range(iters):
        gw = torch.stack([sum(gram[l][m] * w[m] for m in range(L)) for l in range(L)])      # (G w)_l
        w = torch.softmax(gw * gain + base, dim=0).unbind(dim=0)
    return torch.stack(w, dim=-1)


def nash_equilibrium(outputs: torch.Tensor, valid: torch.Tensor, tau, iters: int) -> torch.Tensor:
    """Weights ``[..., L]`` of the scales after ``iters`` best-response rounds.

    ``outputs [..., L, D]`` are the scale outputs (fp32), ``valid`` (broadcastable to ``[..., L]``,
    at least one True per row) says which scales have an output for this token, ``tau`` (> 0,
    broadcastable to ``[..., L]``) is the temperature. Start uniform over the valid scales; each
    round, every scale's loss is its mean squared distance to the consensus ``c = sum_m w_m o_m``
    and the best response is ``softmax(-loss / tau)`` over the valid scales. Squared distances,
    not norms: sqrt has no gradient at 0 (all outputs equal).

    The K rounds are DESIGN 1.2's fusion, not a solved equilibrium: they reach a fixed point of
    the best response where that map contracts (``2 max G / tau < 1``, G the outputs' Gram
    matrix), and otherwise stop short of one: after 3 rounds at tau = 1, a 4th moves the weights
    by up to 0.10 (outputs N(0, 1), 16 dims, 3 scales; the largest over 2,000 tokens) or 0.35
    (N(0, 9)), by 0.006-0.009 on average.
    """
    return nash_rounds(scale_gram(outputs.unbind(dim=-2)), *nash_start(valid, outputs.dtype), tau, iters)


# ----------------------------------------------------------------------------------------------
# Building blocks.

def _rms_inverse(x, eps):
    """``1 / sqrt(mean(x^2) + eps)`` over the last dim (one fused reduction; its gradient is 0,
    not NaN, at x = 0)."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        xf = x.float()
        xf = xf * _rms_inverse(xf, self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None):
    """cos and sin ``[seq_len, head_dim // 2]`` (fp32) of the rotary embedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate ``x [B, T, heads, D]`` by its position (the "rotate half" layout), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` as one opaque op, in its operands' dtype (autocast off).
    AOTAutograd (torch_xla's ``scan``) decomposes an einsum into ``bmm``, whose single batch
    dimension merges all of the operands' (batch and heads), and a split of two of them cannot
    survive that merge; kept whole until it runs, the einsum reaches torch_xla's own lowering,
    one product with every batch dimension its own (an HLO dot with ``lhs_batch_dims``: checked
    by tests/test_model_xla.py). Its backward is two more of it, so the equation is explicit
    (``->``, no ``...``) and every index of an operand appears in the output or in the other
    operand (true of ``attend``'s two)."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.einsum(equation, a, b)


# One name per loaded copy of this file: bench/model.py --model-root loads another checkout's
# model.py beside this one, and a second registration of one name would serve both copies. An op
# name is an identifier, and a module's name need not be one: transformers names an export's copy
# after its directory ("my model", "nash+mhc", "modèle"), so the name is kept to ASCII word
# characters, with a digest of the whole name to keep two such copies apart.
_op_suffix = re.sub(r"\W", "_", __name__, flags=re.ASCII)
if _op_suffix != __name__.replace(".", "_"):
    _op_suffix += "_" + hashlib.sha256(__name__.encode()).hexdigest()[:12]
opaque_einsum = torch.library.custom_op(f"nash_mhc::einsum_{_op_suffix}", _einsum, mutates_args=())
opaque_einsum.register_fake(_einsum)   # the same einsum, on fake tensors


def _opaque_einsum_setup(ctx, inputs, output):
    if "->" not in inputs[0] or "." in inputs[0]:
        raise ValueError(f"opaque_einsum needs an explicit equation (->, no ...): {inputs[0]!r}")
    ctx.equation = inputs[0]
    ctx.save_for_backward(inputs[1], inputs[2])


def _opaque_einsum_backward(ctx, grad):
    (ins, out), (a, b) = ctx.equation.split("->"), ctx.saved_tensors
    x, y = ins.split(",")
    return (None, opaque_einsum(f"{out},{y}->{x}", grad, b) if ctx.needs_input_grad[1] else None,
            opaque_einsum(f"{x},{out}->{y}", a, grad) if ctx.needs_input_grad[2] else None)


opaque_einsum.register_autograd(_opaque_einsum_backward, setup_context=_opaque_einsum_setup)


def attend(q, k, v, bias=None):
    """``softmax(q k^T / sqrt(D) + bias) v``, grouped-query.

    ``q [B, H, T, D]``, ``k, v [B, Hkv, S, D]``; query head h reads key/value head h // (H / Hkv).
    ``bias`` is an additive mask broadcastable to ``[B, H, T, S]``, 0 where a key is visible and
    -inf where it is hidden, with at least one visible key per row (a fully hidden row has no
    defined output), or None for causal attention (``S == T``): through SDPA's own causal path
    in PyTorch, where the kernels skip the blocks above the diagonal.

    On an XLA device SDPA is no kernel but PyTorch's composite math path (scale q and k, turn the
    mask, repeat every key/value head G times, a softmax that zeroes fully hidden rows), so there
    the same formula is written out, which keeps the graph of every attention call small (about a
    third of SDPA's): the G query heads of a key/value head stay a dimension of their own,
    ``[B, Hkv, G, T, D]``, in two ``opaque_einsum`` products with B and Hkv as batch dimensions,
    so heads split over tp stay split. As batched matmuls, whose one batch dimension merges B
    and the heads, they had GSPMD gather the heads (bench/optimizer.py --only tp).
    """
    if q.device.type != "xla":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype),
                                              is_causal=bias is None, enable_gqa=q.shape[1] != k.shape[1])
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if bias is None:
        bias = causal_bias(T, q.device)
    s = opaque_einsum("bhgtd,bhsd->bhgts", (q * D ** -0.5).view(B, Hkv, H // Hkv, T, D), k)
    p = torch.softmax(s.view(B, H, T, S) + bias, dim=-1).to(v.dtype)
    return opaque_einsum("bhgts,bhsd->bhgtd", p.view(B, Hkv, H // Hkv, T, S), v).view(B, H, T, D)


def causal_bias(T: int, device=None) -> torch.Tensor:
    """``[T, T]`` additive causal mask: 0 on and below the diagonal, -inf above it (fp32)."""
    t = torch.arange(T, device=device)
    return _bias(t[None, :] <= t[:, None])


def _bias(visible: torch.Tensor) -> torch.Tensor:
    """A bool visibility mask as an additive one: 0 where visible, -inf where hidden (fp32)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def local_attention(q, k, v, window: int, bias=None):
    """Causal attention at full resolution over the last ``window`` keys (0: all of them).

    ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]``, ``bias`` the mask ``attention_masks`` gives for
    this T as ``local`` (None where it gives none: plain causal). When T > 2 * window the queries
    are cut into chunks of ``window`` that attend to their own and the previous chunk (2 * window
    keys, masked to the window), so the cost is linear in T; otherwise one product over all keys.
    """
    B, H, T, D = q.shape
    if window == 0 or T <= 2 * window:
        return attend(q, k, v, bias)
    W, Hkv = window, k.shape[1]
    nc = -(-T // W)
    pad = nc * W - T
    if pad:  # right padding: padded keys are in every real query's future
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))

    def chunks(x):  # [B, h, nc * W, D] -> [B * nc, h, W, D]
        return x.unflatten(2, (nc, W)).transpose(1, 2).reshape(B * nc, x.shape[1], W, D)

    # keys of chunk c: chunk c - 1 (zeros for c = 0, hidden by the mask) then chunk c; the shift
    # by one chunk is one pad (W rows in front, W cut at the end), whose gradient is one pad too
    kk, vv = (torch.cat([chunks(F.pad(x, (0, 0, W, -W))), chunks(x)], dim=2) for x in (k, v))
    bias = bias.expand(B, nc, 1, W, 2 * W).reshape(B * nc, 1, W, 2 * W)
    out = attend(chunks(q), kk, vv, bias)                     # [B * nc, H, W, D]
    out = out.view(B, nc, H, W, D).transpose(1, 2).reshape(B, H, nc * W, D)
    return out[:, :, :T] if pad else out


def attention_masks(cfg: ModelConfig, T: int, device=None, real: int | None = None) -> dict[str, torch.Tensor]:
    """What NashAttention needs at length T besides its input, the same in every layer: built once
    per forward (``NashMHC.trunk``) and handed to every block, so a traced graph holds it once,
    not once per layer. Additive masks are fp32, 0 where a key is visible and -inf where hidden.

    ``local``: scale 0's window: ``[nc, 1, W, 2 W]`` over the chunks when T > 2 W (query i of
        chunk c sees key j of chunks c - 1 and c iff 0 <= t - s < W and s >= 0), ``[T, T]`` when
        W < T <= 2 W; absent when scale 0 is plain causal (no window, or T <= W).
    ``scale1`` ... ``scale{L-1}``: ``[T, T / r**l]``: query t sees block j iff it is complete,
        (j+1) r**l - 1 <= t. A query with no complete block (t < r**l - 1) sees block 0 instead:
        never a fully hidden row, so its output is finite on every backend, and the aggregation
        gives it weight exactly 0 (0 x finite = 0: nothing of it reaches the result or flows back).
    ``start``, ``hidden`` (L > 1): ``nash_start`` of the scales' validity ``[T, L]``.
    ``token_weight`` (only when ``real`` < T: the input was padded on the right to T): ``[T]``,
        1 / real on the real tokens and 0 on the padding, for the blocks' stats.
    """
    W, t = cfg.nash_window, torch.arange(T, device=device)
    masks = {}
    if W and W < T <= 2 * W:
        masks["local"] = _bias((t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < W))
    elif W and T > 2 * W:
        i = torch.arange(W, device=device)[:, None]               # query offset in its chunk
        j = torch.arange(2 * W, device=device)[None, :]           # key offset from the previous chunk's start
        c = torch.arange(-(-T // W), device=device)[:, None, None]
        masks["local"] = _bias((j > i) & (j <= i + W) & ((c > 0) | (j >= W))).unsqueeze(1)
    if cfg.nash_scales > 1:
        valid = [torch.ones_like(t, dtype=torch.bool)]
        for l in range(1, cfg.nash_scales):
            b = cfg.nash_compression ** l
            j = torch.arange(T // b, device=device)
            valid.append(t >= b - 1)
            visible = ((j[None, :] + 1) * b - 1 <= t[:, None]) | ((j[None, :] == 0) & ~valid[-1][:, None])
            masks[f"scale{l}"] = _bias(visible)
        masks["start"], masks["hidden"] = nash_start(torch.stack(valid, dim=-1))
    if real is not None and real < T:
        masks["token_weight"] = (t < real).float() / real
    return masks


class NashAttention(nn.Module):
    """Grouped-query attention at ``nash_scales`` scales, fused per token and head.

    Scale 0: causal (optionally windowed) attention at full resolution. Scale l >= 1: keys and
    values pooled over blocks of r**l tokens; query t sees block j iff the block is complete,
    (j+1) * r**l - 1 <= t. A query that sees no block (t < r**l - 1) has no output at that scale:
    it is marked invalid for the aggregation, which gives it weight exactly 0.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scales, self.ratio, self.window = cfg.nash_scales, cfg.nash_compression, cfg.nash_window
        self.iters, self.aggregation, self.tau_init = cfg.nash_iters, cfg.aggregation, cfg.nash_tau
        C, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(C, H * D, bias=False)
        self.wk = nn.Linear(C, Hkv * D, bias=False)
        self.wv = nn.Linear(C, Hkv * D, bias=False)
        self.wo = nn.Linear(H * D, C, bias=False)
        self.log_tau = self.agg_logits = self.pool_logits = None
        if self.scales > 1:
            if cfg.aggregation == "nash":
                self.log_tau = nn.Parameter(torch.empty(H))
            elif cfg.aggregation == "convex":
                self.agg_logits = nn.Parameter(torch.empty(self.scales))
            if cfg.nash_pool == "learned":
                self.pool_logits = nn.ParameterList(
                    [nn.Parameter(torch.empty(self.ratio ** l)) for l in range(1, self.scales)])

    def reset_parameters(self):
        if self.log_tau is not None:
            nn.init.constant_(self.log_tau, math.log(self.tau_init))
        if self.agg_logits is not None:
            nn.init.zeros_(self.agg_logits)
        for p in self.pool_logits or []:
            nn.init.zeros_(p)  # starts as the mean

    def pool(self, x, l: int):
        """``[B, Hkv, T, D]`` -> ``[B, Hkv, T / r**l, D]``, each block from its own tokens only."""
        b = self.ratio ** l
        x = x.unflatten(2, (x.shape[2] // b, b))
        if self.pool_logits is None:
            return x.mean(dim=3)
        w = torch.softmax(self.pool_logits[l - 1].float(), dim=0).to(x.dtype)
        return (x * w[:, None]).sum(dim=3)

    def forward(self, x, cos, sin, masks=None):
        """``x [B, T, C]`` -> (``[B, T, C]``, detached stats: Nash entropy, mean weight per scale).
        ``masks``: ``attention_masks`` for this T (built here when not given)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if masks is None:
            masks = attention_masks(self.cfg, T, x.device)
        q = apply_rope(self.wq(x).view(B, T, H, D), cos, sin).transpose(1, 2)     # [B, H, T, D]
        k = apply_rope(self.wk(x).view(B, T, Hkv, D), cos, sin).transpose(1, 2)   # [B, Hkv, T, D]
        v = self.wv(x).view(B, T, Hkv, D).transpose(1, 2)
        outs = [local_attention(q, k, v, self.window, masks.get("local"))]
        if self.scales == 1:
            o, stats = outs[0], x.new_zeros(0, dtype=torch.float32)
        else:
            for l in range(1, self.scales):
                outs.append(attend(q, self.pool(k, l), self.pool(v, l), masks[f"scale{l}"]))
            o, stats = self.aggregate(outs, masks["start"], masks["hidden"], masks.get("token_weight"))
        return self.wo(o.transpose(1, 2).reshape(B, T, H * D)), stats

    def aggregate(self, outs, start, hidden, token_weight=None):
        """Fuse the scale outputs ``[B, H, T, D]`` into one, with stats (over the real tokens:
        ``attention_masks``' ``token_weight``); ``start``, ``hidden`` ``[T, L]``: ``nash_start``
        of the scales' validity.
        The game runs in fp32 under autocast too: its weights at a small temperature move by
        several hundredths when the Gram products are rounded to bf16."""
        with torch.autocast(device_type=outs[0].device.type, enabled=False):
            outs32 = [o.float() for o in outs]
            # On XLA one [L, D] tensor per token: a much smaller graph. Not under torch.compile:
            # its step got slower with it (bench/model.py, with the game's products batched as
            # they were then: nash-only 1.21x -> 1.54x).
            if outs32[0].device.type == "xla":
                outs32 = torch.stack(outs32, dim=-2)                  # [B, H, T, L, D]
            if self.aggregation == "nash" and isinstance(outs32, torch.Tensor):
                tau = self.log_tau.float().exp().view(-1, 1, 1)       # per head
                w = nash_rounds(scale_gram(outs32), start, hidden, tau, self.iters)   # [B, H, T, L]
            elif self.aggregation == "nash":
                tau = self.log_tau.float().exp().view(-1, 1)          # per head, over [B, H, T]
                w = nash_rounds_by_scale(scale_gram_pairs(outs32), start, hidden, tau, self.iters)
            elif self.aggregation == "convex":
                w = torch.softmax(self.agg_logits.float() + hidden, dim=-1)
            else:
                w = start
            if isinstance(outs32, torch.Tensor):
                o = (w.unsqueeze(-1) * outs32).sum(dim=-2).to(outs[0].dtype)
            else:
                o = sum(w[..., l, None] * o_l for l, o_l in enumerate(outs32)).to(outs[0].dtype)
            with torch.no_grad():
                # one mean over the tokens and heads of [entropy, w_0, ..., w_{L-1}]
                entropy = -(w * w.clamp_min(1e-30).log()).sum(dim=-1, keepdim=True)
                per = torch.cat([entropy, w], dim=-1)                              # [..., T, L + 1]
                if token_weight is None:
                    stats = per.reshape(-1, self.scales + 1).mean(dim=0)
                else:  # padded on the right: the real tokens' mean
                    T = token_weight.shape[0]
                    stats = (per.reshape(-1, T, self.scales + 1).mean(dim=0) * token_weight[:, None]).sum(dim=0)
                if self.log_tau is not None:  # read here, where FSDP2 has the parameter gathered
                    stats = torch.cat([stats, self.log_tau.float().exp().mean().view(1)])
            return o, stats


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ----------------------------------------------------------------------------------------------
# mHC: the stream ops and the hyper-connections.
#
# The three ops that touch the n-times wider residual (the normalised projection that gives the
# coefficients, the stream read and the stream write) each come in two forms of the same maths:
# plain differentiable tensor ops, which a fusing compiler (torch.compile's inductor, XLA) turns
# into single passes over the streams, and an autograd.Function for eager PyTorch, whose batched
# products and spelled-out backward make fewer passes over, and fewer temporaries of, the wide
# tensors there. Which form runs follows from where the graph goes (`_fusing`); bench/model.py
# measures both on every backend. The write has a third, shaped for XLA's fusion (PJRT CPU,
# bench/model.py --model-root against the inductor form: mhc-only 1.31x -> 1.28x the baseline's
# step). Coefficients are fp32 whatever the streams' dtype.

def _fusing(x: torch.Tensor) -> bool:
    """True while tracing for a fusing compiler: torch.compile, or a lazy XLA tensor."""
    return torch.compiler.is_compiling() or x.device.type == "xla"


def normed_projection(x, w, eps):
    """``(x @ w^T) / sqrt(mean(x^2) + eps)`` over the last dim of ``x [..., K]``, in fp32 (``w``
    fp32, ``x`` in the streams' dtype): the projection of the RMS-normalised x (no weight), without
    materialising it."""
    if _fusing(x):
        x = x.float()
        return F.linear(x, w) * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return _NormedProjection.apply(x, w, eps)


class NormedLinear(nn.Linear):
    """mHC's projection ``phi``: a bias-free Linear whose forward is ``normed_projection`` of its
    input (the RMS norm folded in, fp32 weight). A Linear, so what treats Linears alike treats it
    alike: its init, FLOP count, optimiser group, and the SPMD backend's activation sharding."""

    def __init__(self, in_features: int, out_features: int, eps: float):
        super().__init__(in_features, out_features, bias=False)
        self.eps = eps

    def forward(self, x):
        return normed_projection(x, self.weight.float(), self.eps)


def stream_read(w, h):
    """``x = sum_i w_i h_i`` per token, in fp32 (``w [..., n]`` fp32, ``h [..., n, C]``)."""
    if _fusing(h):
        return (w.unsqueeze(-1) * h).sum(dim=-2)
    return _StreamRead.apply(w, h)


def stream_write(h, y, res, post):
    """``H_res h + H_post^T y`` per token (``h [..., n, C]``, ``y [..., C]``, ``res [..., n, n]``
    and ``post [..., n]`` fp32), computed in fp32 and rounded once to h's dtype."""
    if h.device.type == "xla":
        # one mix of [h; y] by [H_res | H_post]: the output's gradient then has two consumers (the
        # gradients of the matrix and of [h; y]) instead of four, and XLA CPU recomputes that
        # gradient's element-wise producers inside every consumer it fuses them into
        hy = torch.cat([h.to(res.dtype), y.to(res.dtype).unsqueeze(-2)], dim=-2)          # [..., n + 1, C]
        return _grouped_mix(torch.cat([res, post.unsqueeze(-1)], dim=-1), hy).to(h.dtype)
    if _fusing(h):   # torch.compile
        out = (res.unsqueeze(-1) * h.unsqueeze(-3)).sum(dim=-2) + post.unsqueeze(-1) * y.unsqueeze(-2)
        return out.to(h.dtype)
    return _StreamWrite.apply(h, y, res, post)


def _grouped_mix(m, x, groups: int = 8):
    """``sum_j m_ij x_j`` per token (``m [..., n, k]``, ``x [..., k, C]``) for XLA, with the channels
    viewed as ``groups`` groups of C / groups and m broadcast over the groups in a step of its own:
    the same products and sums, but the gradient of m, one sum of C products per entry, is then
    reduced over (groups, C / groups), which XLA CPU runs 3-4x faster than over C (15 -> 4 ms at
    issue 13's shape; not measured on TPU)."""
    C = x.shape[-1]
    if C % groups:
        return (m.unsqueeze(-1) * x.unsqueeze(-3)).sum(dim=-2)
    mg = m.unsqueeze(-1).expand(*m.shape, groups).unsqueeze(-1)                # [..., n, k, groups, 1]
    return (mg * x.unflatten(-1, (groups, C // groups)).unsqueeze(-4)).sum(dim=-3).flatten(-2)


class _NormedProjection(torch.autograd.Function):
    """``normed_projection`` for eager PyTorch: ``z = (x @ w^T) * r`` with ``r = 1 / sqrt(mean(x^2) + eps)``.
    The backward is written out, ``dx = (g r) @ w - x r^3 sum(g * (x @ w^T)) / K``: one product and
    one fused update of the n-times wide input, where autograd's takes five passes over it. It
    keeps x in its own dtype (bf16 streams: no fp32 copy of them lives until the backward)."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        xf = x.to(w.dtype)
        r = torch.rsqrt(torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square() / x.shape[-1] + eps)
        proj = F.linear(xf, w)
        ctx.save_for_backward(x, w, r, proj)
        return proj * r

    @staticmethod
    @once_differentiable  # r and proj are saved without their graph: a second derivative would miss them
    def backward(ctx, g):
        x, w, r, proj = ctx.saved_tensors
        xf = x.to(w.dtype)
        gr = g * r
        grad_x = torch.matmul(gr, w)
        grad_x.addcmul_(xf, (g * proj).sum(dim=-1, keepdim=True) * r.pow(3) / -x.shape[-1])
        grad_w = torch.matmul(gr.reshape(-1, gr.shape[-1]).t(), xf.reshape(-1, x.shape[-1]))
        return grad_x.to(x.dtype), grad_w, None


# The two stream ops below reduce with (batched) products instead of broadcast-multiply-and-sum:
# in eager PyTorch on the CPU most of mHC's time went to allocating and faulting in the
# [..., n, C] temporaries that autograd's versions create. They compute in the coefficients' dtype
# (fp32) and give each input's gradient in its own dtype (the streams may be bf16, the sub-layer
# output bf16 under autocast). A per-token dot product over C (the gradients of the read's weights
# and of H_post) is a row times a matrix, ``[1, C] @ [C, n]``: as a matrix times a column,
# ``[n, C] @ [C, 1]``, CPU BLAS took 5x as long (1.7 against 0.3 ms at issue 13's shape).

class _StreamRead(torch.autograd.Function):
    """``stream_read`` for eager PyTorch."""

    @staticmethod
    def forward(ctx, w, h):
        ctx.save_for_backward(w, h)
        return torch.matmul(w.unsqueeze(-2), h.to(w.dtype)).squeeze(-2)

    @staticmethod
    def backward(ctx, g):
        w, h = ctx.saved_tensors
        g = g.to(w.dtype)
        grad_w = torch.matmul(g.unsqueeze(-2), h.to(w.dtype).transpose(-1, -2)).squeeze(-2)
        return grad_w, (w.unsqueeze(-1) * g.unsqueeze(-2)).to(h.dtype)


class _StreamWrite(torch.autograd.Function):
    """``stream_write`` for eager PyTorch."""

    @staticmethod
    def forward(ctx, h, y, res, post):
        ctx.save_for_backward(h, y, res, post)
        out = torch.matmul(res, h.to(res.dtype)).addcmul_(post.unsqueeze(-1), y.to(res.dtype).unsqueeze(-2))
        return out.to(h.dtype)

    @staticmethod
    def backward(ctx, g):
        h, y, res, post = ctx.saved_tensors
        g = g.to(res.dtype)
        grad_h = torch.matmul(res.transpose(-1, -2), g).to(h.dtype)
        grad_y = torch.matmul(post.unsqueeze(-2), g).squeeze(-2).to(y.dtype)
        grad_res = torch.matmul(g, h.to(res.dtype).transpose(-1, -2))
        grad_post = torch.matmul(y.to(res.dtype).unsqueeze(-2), g.transpose(-1, -2)).squeeze(-2)
        return grad_h, grad_y, grad_res, grad_post


def permutation_matrices(n: int, device=None) -> torch.Tensor:
    """All n! permutation matrices ``[n!, n, n]``, the identity first."""
    perms = torch.tensor(list(itertools.permutations(range(n))), device=device)
    return F.one_hot(perms, n).float()


class HyperConnection(nn.Module):
    """mHC around one sub-layer F: ``h <- H_res h + H_post^T F(H_pre h)`` with per-token
    ``H_pre = sigmoid(.)``, ``H_post = 2 sigmoid(.)`` (``[n]``) and doubly-stochastic ``H_res [n, n]``,
    each ``alpha * (phi rmsnorm(flat h)) + b``; coefficient maths in fp32, outside autocast.
    """

    def __init__(self, cfg: ModelConfig, favoured: int):
        super().__init__()
        n = cfg.mhc_streams
        self.n, self.iters, self.lite = n, cfg.sinkhorn_iters, cfg.mhc_lite
        self.favoured = favoured
        self.n_res = math.factorial(n) if cfg.mhc_lite else n * n
        self.phi = NormedLinear(n * cfg.d_model, 2 * n + self.n_res, cfg.norm_eps)
        self.alpha = nn.Parameter(torch.empty(3))                # gates of pre, post, res
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(self.n_res))      # flat: every no-decay parameter is < 2-D
        self.sinkhorn_iterate = None   # sinkhorn_knopp's ``iterate``: the XLA backend may set it
        # what the XLA backend sets in SPMD: a function that annotates the coefficients' logits
        # with the batch's split (``XLABackend._shard_activations``). Left to GSPMD, in a scanned
        # block on a tp mesh the logits came out split over tp, and the streams with them.
        self.annotate_logits = None
        # alpha spread over the 2n + n_res logits (row k: 1 on gate k's logits), so the three gates
        # and biases are one multiply-add: a third of the ops, and of their gradient reductions
        self.register_buffer("gate_spread", torch.empty(3, 2 * n + self.n_res), persistent=False)
        if self.lite:
            self.register_buffer("perms", torch.empty(self.n_res, n, n), persistent=False)

    @torch.no_grad()
    def reset_parameters(self):
        n = self.n
        self.alpha.fill_(MHC_GATE_INIT)
        self.b_pre.fill_(-MHC_PRE_BIAS)
        self.b_pre[self.favoured] = MHC_PRE_BIAS
        self.b_post.zero_()                                      # 2 sigmoid(0) = 1
        if self.lite:
            # an off-diagonal entry sums the weights of the (n-1)! permutations through it: this bias
            # starts every one at ~exp(MHC_RES_OFF_DIAG_BIAS), Sinkhorn's start
            self.b_res.fill_(MHC_RES_OFF_DIAG_BIAS - math.log(math.factorial(n - 1)))
            self.b_res[0] = 0.0                                  # the identity permutation
        else:
            eye = torch.eye(n, device=self.b_res.device).flatten()
            self.b_res.copy_((1.0 - eye) * MHC_RES_OFF_DIAG_BIAS)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self):
        """The non-persistent buffers, which follow from the shape: ``gate_spread`` and the lite permutations."""
        gate_of = [0] * self.n + [1] * self.n + [2] * self.n_res
        spread = [[float(g == k) for g in gate_of] for k in range(3)]
        self.gate_spread.copy_(torch.tensor(spread, device=self.gate_spread.device))
        if self.lite:
            self.perms.copy_(permutation_matrices(self.n, device=self.perms.device))

    def coefficients(self, h):
        """fp32 ``H_pre [B, T, n]``, ``H_post [B, T, n]``, ``H_res [B, T, n, n]`` for ``h [B, T, n, C]``."""
        n = self.n
        with torch.autocast(device_type=h.device.type, enabled=False):
            z = self.phi(h.flatten(-2))
            bias = torch.cat([self.b_pre, self.b_post, self.b_res]).float()
            z = z * (self.alpha.float() @ self.gate_spread.float()) + bias
            if self.annotate_logits is not None:
                z = self.annotate_logits(z)
            gates, res = z.split([2 * n, self.n_res], dim=-1)   # split: its gradient is one concatenation
            h_pre, h_post = torch.sigmoid(gates).split([n, n], dim=-1)
            h_post = 2.0 * h_post
            if self.lite:
                h_res = torch.einsum("btk,kij->btij", torch.softmax(res, dim=-1), self.perms.float())
            else:
                h_res = sinkhorn_knopp(res.unflatten(-1, (n, n)), self.iters, iterate=self.sinkhorn_iterate)
        return h_pre, h_post, h_res

    def read(self, h):
        """The sub-layer input ``H_pre h [B, T, C]`` and the coefficients ``write`` needs. The sum
        is fp32; it is handed on in the parameters' dtype (fp32 under autocast, bf16 in a model
        cast to bf16, whose Linears take bf16 only)."""
        h_pre, h_post, h_res = self.coefficients(h)
        with torch.autocast(device_type=h.device.type, enabled=False):
            return stream_read(h_pre, h).to(self.phi.weight.dtype), (h_post, h_res)

    def write(self, h, y, coef):
        """``H_res h + H_post^T y`` for the sub-layer output ``y [B, T, C]``, in fp32 even under
        autocast (a bf16 product here would round the residual every sub-layer), stored in h's dtype."""
        h_post, h_res = coef
        with torch.autocast(device_type=h.device.type, enabled=False):
            return stream_write(h, y, h_res, h_post)


class StreamCollapse(nn.Module):
    """Before the final norm: ``x = sum_i w_i h_i`` (in fp32, handed on in the parameters' dtype) with
    per-token ``w = sigmoid(.) >= 0``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.mhc_streams
        self.phi = NormedLinear(n * cfg.d_model, n, cfg.norm_eps)
        self.alpha = nn.Parameter(torch.empty(1))
        self.bias = nn.Parameter(torch.empty(n))

    @torch.no_grad()
    def reset_parameters(self):
        self.alpha.fill_(MHC_GATE_INIT)
        self.bias.zero_()  # w = 1/2 everywhere: the final norm makes the scale irrelevant

    def forward(self, h):
        with torch.autocast(device_type=h.device.type, enabled=False):
            z = self.phi(h.flatten(-2))
            w = torch.sigmoid(self.alpha.float() * z + self.bias.float())
            return stream_read(w, h).to(self.phi.weight.dtype)   # as in HyperConnection.read


def _mean_diagonal(m, token_weight=None):
    """The mean diagonal entry of the matrices ``m [..., T, n, n]``: every (n+1)-th entry of the
    flattened matrices (a strided slice; ``diagonal()`` costs XLA twice the graph); with
    ``token_weight [T]`` (``attention_masks``), over the real tokens only."""
    n = m.shape[-1]
    d = m.flatten(-2)[..., :: n + 1]
    if token_weight is None:
        return d.mean()
    return (d.mean(dim=-1).reshape(-1, token_weight.shape[0]).mean(dim=0) * token_weight).sum()


class Block(nn.Module):
    """Pre-norm attention and SwiGLU sub-layers, each in a hyper-connection (or a plain residual
    when mhc_streams == 1). Returns the new residual and a detached 1-D stats tensor: the
    attention's, then (mHC) the mean diagonal of H_res and the mean |gate| of the two
    hyper-connections. Stats of parameters are taken here too, not from the model after the
    forward: under FSDP2 a block's parameters are whole only during its own forward (read from
    outside, each would be one more all-gather per step)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.streams = cfg.mhc_streams
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = NashAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        if self.streams > 1:
            self.hc_attn = HyperConnection(cfg, favoured=(2 * layer) % cfg.mhc_streams)
            self.hc_ffn = HyperConnection(cfg, favoured=(2 * layer + 1) % cfg.mhc_streams)

    def forward(self, h, cos, sin, masks=None):
        """``h`` the residual (``[B, T, C]``, or ``[B, T, n, C]`` with n streams), ``cos, sin`` the
        rotary tables ``[T, D / 2]``, ``masks`` the ``attention_masks`` for T (None: built here)."""
        if self.streams == 1:
            a, stats = self.attn(self.attn_norm(h), cos, sin, masks)
            h = h + self.drop(a)
            h = h + self.drop(self.ffn(self.ffn_norm(h)))
            return h, stats
        x, coef = self.hc_attn.read(h)
        a, stats = self.attn(self.attn_norm(x), cos, sin, masks)
        h = self.hc_attn.write(h, self.drop(a), coef)
        weight = masks.get("token_weight") if masks is not None else None
        res_diag = _mean_diagonal(coef[1].detach(), weight)
        x, coef = self.hc_ffn.read(h)
        h = self.hc_ffn.write(h, self.drop(self.ffn(self.ffn_norm(x))), coef)
        res_diag = (res_diag + _mean_diagonal(coef[1].detach(), weight)) / 2
        gate = torch.cat([self.hc_attn.alpha, self.hc_ffn.alpha]).detach().float().abs().mean()
        return h, torch.cat([stats, res_diag.view(1), gate.view(1)])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over targets != -1, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


# ----------------------------------------------------------------------------------------------
# The model.

class NashMHC(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.mhc_out = StreamCollapse(cfg) if cfg.mhc_streams > 1 else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        # The XLA backend may swap in torch_xla's own checkpoint; used only when training with grad.
        self.checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        # The XLA backend may run all blocks as one compiled loop body (torch_xla's scan):
        # blocks_fn(blocks, h, cos, sin, masks, checkpoint) -> (h, the blocks' mean stats).
        self.blocks_fn = None
        # train.py's training.compile swaps in a compiled lm_loss (the fp32 cast fused into it).
        self.loss_fn = lm_loss
        names = []  # the blocks' stats, in Block.forward's order
        if cfg.nash_scales > 1:
            names += ["nash_entropy"] + [f"nash_w{l}" for l in range(cfg.nash_scales)]
            names += ["nash_tau"] if cfg.aggregation == "nash" else []
        if cfg.mhc_streams > 1:
            names += ["mhc_res_diag", "mhc_gate"]
        self.stat_names = names
        self.init_weights()

    def _apply(self, fn, *args, **kwargs):
        # Moving to a device whose tensors cannot share a CPU tensor's storage type (XLA) replaces
        # each Parameter with a new one, which unties lm_head from tok_emb: tie them again.
        super()._apply(fn, *args, **kwargs)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        return self

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialise every parameter and buffer; call it after ``to_empty()``.

        Weights N(0, init_std); the projections into the residual (wo, w2) and an untied LM head
        N(0, init_std / sqrt(2 n_layers)) (GPT-2), so the initial loss is ~ln(vocab_size).
        """
        for name, m in self.named_modules():
            self.init_module(name, m)
        self.init_buffers()

    @torch.no_grad()
    def init_module(self, name: str, m: nn.Module) -> None:
        """``init_weights`` for one module ``m`` named ``name`` in this model: its own parameters."""
        cfg = self.config
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        if isinstance(m, nn.Linear) and not (m is self.lm_head and cfg.tie_embeddings):
            small = name.endswith((".wo", ".w2")) or m is self.lm_head
            nn.init.normal_(m.weight, 0.0, out_std if small else std)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, (RMSNorm, NashAttention, HyperConnection, StreamCollapse)):
            m.reset_parameters()

    @torch.no_grad()
    def init_buffers(self):
        """(Re)compute the non-persistent buffers: the rotary tables and the hyper-connections' own.
        They follow from the config and are never saved, so a model whose parameters were loaded
        into a meta-built module (``load_state_dict(assign=True)``, transformers' from_pretrained)
        calls this and nothing else."""
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for m in self.modules():
            if isinstance(m, HyperConnection):
                m.init_buffers()

    def trunk(self, idx):
        """Final-normed hidden states ``[B, T, C]`` and the blocks' mean stats."""
        cfg = self.config
        B, T = idx.shape
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length {T} is above max_seq_len={cfg.max_seq_len}")
        Tp = -(-T // cfg.coarsest_block) * cfg.coarsest_block
        if Tp != T:  # right padding cannot change earlier outputs of a causal model
            idx = F.pad(idx, (0, Tp - T))
        cos, sin = self.rope_cos[:Tp], self.rope_sin[:Tp]
        masks = attention_masks(cfg, Tp, idx.device, real=T)  # once for all the blocks
        h = self.drop(self.tok_emb(idx))
        if cfg.mhc_streams > 1:
            h = h.unsqueeze(2).expand(B, Tp, cfg.mhc_streams, cfg.d_model)
            h = h.to(STREAM_DTYPES[cfg.stream_dtype]).contiguous()
        checkpoint = cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        if self.blocks_fn is not None:
            h, stats = self.blocks_fn(self.blocks, h, cos, sin, masks, checkpoint)
        else:
            stats = []
            for block in self.blocks:
                h, s = self.checkpoint_fn(block, h, cos, sin, masks) if checkpoint else block(h, cos, sin, masks)
                stats.append(s)
            stats = torch.stack(stats).mean(dim=0)
        if self.mhc_out is not None:
            h = self.mhc_out(h)
        return self.norm(h[:, :T]), stats

    def forward(self, idx, targets=None) -> ModelOutput:
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} differs from idx shape {tuple(idx.shape)}")
        x, stats = self.trunk(idx)
        if targets is not None and self.config.loss_chunk:
            loss = self._chunked_loss(x, targets)
            return ModelOutput(None, loss, self._metrics(stats))
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = self.loss_fn(logits, targets)
        return ModelOutput(logits, loss, self._metrics(stats))

    def _chunked_loss(self, x, targets):
        """The mean cross-entropy over targets != -1 of ``x [B, T, C]``, ``loss_chunk`` positions
        of every sequence at a time: each chunk's logits (and their fp32 copy, log-probabilities and
        gradient) exist only while that chunk is computed, its forward again in the backward pass
        (checkpointed). Chunks cut the sequence axis, not the batch, so that on an SPMD mesh (the
        batch split over data x fsdp) every chunk is spread over every device."""
        def chunk_loss(xc, weight, tc):  # summed, so that chunks of any size add up to the mean
            logits = F.linear(xc, weight).float()
            return F.cross_entropy(logits.flatten(0, 1), tc.flatten(), ignore_index=-1, reduction="sum")

        recompute = self.training and torch.is_grad_enabled()
        total = x.new_zeros((), dtype=torch.float32)
        for xc, tc in zip(x.split(self.config.loss_chunk, dim=1), targets.split(self.config.loss_chunk, dim=1)):
            args = (chunk_loss, xc, self.lm_head.weight, tc)
            total = total + (self.checkpoint_fn(*args) if recompute else args[0](*args[1:]))
        return total / (targets != -1).sum()

    def _metrics(self, stats):
        """The blocks' mean stats by name (``stat_names``): ``nash_entropy``, ``nash_w*``,
        ``nash_tau`` (mean temperature), ``mhc_res_diag``, ``mhc_gate`` (mean |alpha| of the
        hyper-connections)."""
        return {name: stats[i].detach() for i, name in enumerate(self.stat_names)}

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 vocab_limit: Optional[int] = None, stop_id: Optional[int] = None,
                 generator: Optional[torch.Generator] = None):
        """Append up to ``max_new_tokens`` sampled tokens to ``idx [B, T]`` (context cropped to
        max_seq_len; no KV cache: each token is one forward pass over the context).
        ``temperature <= 0`` (or so small that it is 0 in fp32): greedy; one past fp32's range is an
        error; ``top_k``: sample among the k likeliest tokens, None: all of
        them; ``vocab_limit``: only ids below it (a vocabulary rounded up past the tokenizer's has
        rows no text maps to); ``stop_id``: stop once every row has produced it (rows that end
        earlier go on: cut them at their first ``stop_id``); ``generator``: the random stream.
        Runs in eval mode and restores the mode."""
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: expected at least 1, or None for all tokens")
        if idx.shape[-1] == 0:
            raise ValueError("generate needs at least one prompt token")
        # the logits are fp32: a temperature must be one there (1e-50 is 0, and x / 0 is NaN at the
        # row maximum; 1e39 is inf, and -inf / inf is NaN in the rows past vocab_limit)
        temperature = float(torch.tensor(temperature, dtype=torch.float32))
        if not math.isfinite(temperature):
            raise ValueError(f"temperature={temperature}: expected a finite number (fp32: below 3.4e38)")
        was_training = self.training
        self.eval()
        stopped = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        try:
            for _ in range(max_new_tokens):
                x, _ = self.trunk(idx[:, -self.config.max_seq_len:])
                logits = self.lm_head(x[:, -1]).float()
                if vocab_limit is not None:
                    logits[:, vocab_limit:] = float("-inf")
                if temperature <= 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    # shifted by the row maximum first: a tiny temperature is near-greedy, not inf - inf
                    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)
                idx = torch.cat([idx, nxt], dim=1)
                if stop_id is not None:
                    stopped |= nxt[:, 0] == stop_id
                    if bool(stopped.all()):
                        break
        finally:
            self.train(was_training)
        return idx

    # ------------------------------------------------------------------------------------------
    # Accounting: parameters and FLOPs.

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, a tied tensor once; ``non_embedding`` leaves out the vocabulary matrices
        (the token embedding and an untied LM head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def component_params(self) -> dict[str, int]:
        """Parameters per component: embedding, lm_head (untied only), attention, nash, mhc, ffn, norms."""
        out = dict.fromkeys(["embedding", "lm_head", "attention", "nash", "mhc", "ffn", "norms"], 0)
        for name, p in self.named_parameters():
            out[_component(name)] += p.numel()
        if self.config.tie_embeddings:
            del out["lm_head"]
        return out

    def flops_breakdown(self, seq_len: Optional[int] = None) -> dict[str, float]:
        """Training (forward + backward) FLOPs per token by component, at ``seq_len`` tokens.

        Matmuls count 6 per weight per token. Attention (as in PaLM's MFU, causal masking not
        subtracted): ``12 * H * D`` per key a query is scored against: min(window, T) keys at
        scale 0 ("attention"), T / r**l at the coarser scales ("nash", with the aggregation: the
        weighted sum of the L scale outputs, 6 * L * C; with ``aggregation: nash`` also their Gram
        matrix, 3 * L (L + 1) * C (its L (L + 1) / 2 distinct products of D numbers per head),
        and the rounds' [L, L] products, 6 * nash_iters * L^2 * H). mHC: its projections phi and the stream
        mixing (H_res, H_pre, H_post: 6 * (n^2 + 2n) * C per sub-layer). Norms, softmax, Sinkhorn
        and other element-wise work are not counted.
        """
        cfg = self.config
        T = -(-(seq_len or cfg.max_seq_len) // cfg.coarsest_block) * cfg.coarsest_block
        C, H, D, n = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.mhc_streams
        L, r = cfg.nash_scales, cfg.nash_compression
        matmul = {"attention": 0, "ffn": 0, "mhc": 0}
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear) and m is not self.lm_head:
                matmul[_component(name + ".weight")] += m.weight.numel()
        keys0 = min(cfg.nash_window, T) if cfg.nash_window else T
        coarse = sum(T // r ** l for l in range(1, L))
        agg = 6 * L * C if L > 1 else 0
        if L > 1 and cfg.aggregation == "nash":
            agg += 3 * L * (L + 1) * C + 6 * cfg.nash_iters * L * L * H
        mixing = 2 * 6 * (n * n + 2 * n) * C if n > 1 else 0
        per_layer = cfg.n_layers
        return {
            "attention": 6.0 * matmul["attention"] + 12.0 * H * D * keys0 * per_layer,
            "nash": (12.0 * H * D * coarse + agg) * per_layer,
            "mhc": 6.0 * matmul["mhc"] + mixing * per_layer + (6 * n * C if n > 1 else 0),
            "ffn": 6.0 * matmul["ffn"],
            "lm_head": 6.0 * C * cfg.vocab_size,
        }

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_len``: the MFU numerator."""
        return float(sum(self.flops_breakdown(seq_len).values()))

    def summary(self, seq_len: Optional[int] = None) -> str:
        cfg = self.config
        seq_len = seq_len or cfg.max_seq_len
        total, non_emb = self.num_params(), self.num_params(non_embedding=True)
        params = self.component_params()
        flops = self.flops_breakdown(seq_len)
        fpt = sum(flops.values())
        window = cfg.nash_window or "none"
        lines = [
            f"Nash-MHC: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv, "
            f"head_dim {cfg.head_dim}), SwiGLU hidden {cfg.ffn_hidden}, vocab {cfg.vocab_size}, "
            f"max_seq_len {cfg.max_seq_len}, {'tied' if cfg.tie_embeddings else 'untied'} embeddings",
            f"  mHC: {cfg.mhc_streams} streams, H_res by "
            + (f"mHC-lite ({math.factorial(cfg.mhc_streams)} permutations)" if cfg.mhc_lite
               else f"Sinkhorn ({cfg.sinkhorn_iters} iterations)")
            + f" | Nash: {cfg.nash_scales} scales, compression {cfg.nash_compression}, window {window}, "
              f"{cfg.nash_iters} rounds, aggregation {cfg.aggregation}, pooling {cfg.nash_pool}",
            f"parameters: {total:,} ({total / 1e9:.3f}B); non-embedding {non_emb:,} ({non_emb / 1e9:.3f}B)",
            f"training FLOPs/token at seq_len {seq_len}: {fpt:.4g} ({fpt / 1e9:.2f} GFLOP; 6N = "
            f"{6 * total / 1e9:.2f} GFLOP)",
            f"{'component':<12}{'params':>16}{'share':>9}{'FLOPs/token':>16}{'share':>9}",
        ]
        for name in ["embedding", "lm_head", "attention", "nash", "mhc", "ffn", "norms"]:
            if name not in params and name not in flops:
                continue
            p, f = params.get(name, 0), flops.get(name, 0.0)
            lines.append(f"{name:<12}{p:>16,}{100 * p / total:>8.2f}%{f:>16.4g}{100 * f / fpt:>8.2f}%")
        return "\n".join(lines)


def _component(name: str) -> str:
    """The summary component of a parameter name."""
    leaf = name.split(".")
    if leaf[0] == "tok_emb":
        return "embedding"
    if leaf[0] == "lm_head":
        return "lm_head"
    if leaf[0] == "mhc_out" or (len(leaf) > 2 and leaf[2] in ("hc_attn", "hc_ffn")):
        return "mhc"
    if "norm" in leaf[-2]:
        return "norms"
    if leaf[2] == "ffn":
        return "ffn"
    if leaf[3] in ("log_tau", "agg_logits", "pool_logits"):
        return "nash"
    return "attention"


def unique_key_loader():
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps
    the last one silently: an edited config would quietly train something else). ``_key`` turns a
    constructed key into what is compared (a subclass that wraps scalars unwraps them there)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        @staticmethod
        def _key(obj):
            return obj

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self._key(self.construct_object(key_node, deep=True))
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r}", key_node.start_mark)
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader says so itself
                    pass
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def load_model_config(path: str) -> ModelConfig:
    """The ``model:`` section of a YAML config file (a key given twice is an error, as in training)."""
    import yaml

    with open(path) as f:
        tree = yaml.load(f, Loader=unique_key_loader())
    if not isinstance(tree, dict) or "model" not in tree:
        raise ValueError(f"{path}: no 'model:' section")
    return ModelConfig.from_dict(tree["model"] if tree["model"] is not None else {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Summary of a Nash-MHC model config (built on the meta "
                                                 "device: nothing is allocated).")
    parser.add_argument("config", help="YAML file with a model: section")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length for FLOPs "
                                                                  "(default: max_seq_len)")
    args = parser.parse_args(argv)
    import yaml

    try:
        cfg = load_model_config(args.config)
        if args.seq_len is not None and not 1 <= args.seq_len <= cfg.max_seq_len:
            raise ValueError(f"--seq-len={args.seq_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
    except (OSError, ValueError, yaml.YAMLError) as e:  # one line, no traceback
        msg = " ".join(str(e).split())
        print(f"error: {args.config}: {msg}" if args.config not in msg else f"error: {msg}", file=sys.stderr)
        return 2
    with torch.device("meta"):
        model = NashMHC(cfg)
    print(f"{args.config}")
    print(model.summary(args.seq_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
