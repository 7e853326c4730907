"""Routing locality: the coverage curve, expert popularity, the union of experts a step touches, and misses per step.

Coverage curve c(x): share of token->expert routings served when the hottest share x of each layer's experts is
cached. Family (concave, c(0)=0, c(1)=1):

    c(x) = w * (1 - (1 - x)^a) + (1 - w) * (1 - (1 - x)^b),   a >= b >= 1

a "hot" part holding routing mass w that saturates quickly (steepness a) plus a colder tail that is itself mildly
skewed (steepness b; b = 1 is a uniform tail). Fitted per model to ModelSpec.coverage_points with weak priors on a
and b (they only decide what the points cannot: DeepSeek-V4-Flash has one point); models without points get the
documented default (hwdb/calibration/cost_model.yaml, routing.default_coverage: flatter than the measured models).

Misses are correlated (a token that leaves the hot set in one layer tends to leave it in others; consecutive tokens
route alike), so P(step has >= 1 miss) is computed from a beta-binomial: the per-step miss propensity q ~ Beta with
mean mu and intra-step correlation rho. Same mean miss count as the independent model, but misses cluster: more
steps have none, and the steps that miss fetch more. rho = 0 recovers independence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from moetplan.cost_model.calibration import Calibration, RoutingFactors, load_calibration
from moetplan.contract.model import ModelSpec


@dataclass(frozen=True)
class CoverageCurve:
    hot_mass: float
    steepness: float
    tail_steepness: float = 1.0
    points: tuple[tuple[float, float], ...] = ()
    fitted: bool = False

    def __call__(self, x: float) -> float:
        x = min(max(float(x), 0.0), 1.0)
        w = self.hot_mass
        return w * (1.0 - (1.0 - x) ** self.steepness) + (1.0 - w) * (1.0 - (1.0 - x) ** self.tail_steepness)

    def max_error(self) -> float:
        return max((abs(self(x) - y) for x, y in self.points), default=0.0)


@lru_cache(maxsize=256)
def fit_curve(points: tuple[tuple[float, float], ...], prior_steepness: float, prior_tail: float,
              default_mass: float, default_steepness: float, default_tail: float) -> CoverageCurve:
    """Least squares on the published points, with weak pulls of both steepnesses toward their priors.

    For fixed steepnesses the hot mass enters linearly (closed form), so the fit is a 2-D scan over log(a), b. The
    priors are weak (1e-4 per squared log-unit): they decide only what the points leave open.
    """
    if not points:
        return CoverageCurve(default_mass, default_steepness, default_tail, (), False)
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    best: tuple[float, float, float, float] | None = None
    for b in np.linspace(1.0, 6.0, 51):
        tail = 1.0 - (1.0 - xs) ** b
        for a in np.exp(np.linspace(np.log(max(b, 1.5)), np.log(400.0), 300)):
            d = (1.0 - (1.0 - xs) ** a) - tail
            denom = float(d @ d)
            w = float((ys - tail) @ d / denom) if denom > 0 else 0.0
            w = min(max(w, 0.0), 1.0)
            resid = float(np.sum((tail + w * d - ys) ** 2))
            obj = resid + 1e-4 * ((math.log(a / prior_steepness)) ** 2 + (math.log(b / prior_tail)) ** 2)
            if best is None or obj < best[0]:
                best = (obj, w, float(a), float(b))
    assert best is not None
    return CoverageCurve(best[1], best[2], best[3], points, True)


def curve_for(model: ModelSpec, routing: RoutingFactors | None = None) -> CoverageCurve:
    r = routing or load_calibration().routing
    pts = tuple((float(x), float(y)) for x, y in model.coverage_points)
    d = r.default_coverage
    return fit_curve(pts, r.coverage_prior_steepness, r.coverage_prior_tail, d.hot_mass, d.steepness,
                     d.tail_steepness)


def coverage(model: ModelSpec, cached_share: float, calib: Calibration | None = None) -> float:
    """Share of token->expert routings served when the hottest `cached_share` of each layer's experts is cached."""
    routing = (calib or load_calibration()).routing
    return curve_for(model, routing)(cached_share)


@lru_cache(maxsize=256)
def _popularity(curve: CoverageCurve, n_experts: int) -> np.ndarray:
    grid = np.arange(n_experts + 1) / n_experts
    c = np.array([curve(x) for x in grid])
    return np.diff(c)  # hottest first: the curve is concave


def expert_popularity(model: ModelSpec, calib: Calibration | None = None) -> list[float]:
    """Each routed expert's share of one layer's routings, hottest first: the coverage curve's steps (what the
    locality router of `moetplan run --router locality` reproduces)."""
    routing = (calib or load_calibration()).routing
    return [float(v) for v in _popularity(curve_for(model, routing), model.n_routed_experts)]


def inclusion_probs(curve: CoverageCurve, n_experts: int, top_k: int) -> np.ndarray:
    """P(expert i is among one token's top-k), hottest first."""
    return np.minimum(1.0, top_k * _popularity(curve, n_experts))


def _log_untouched(curve: CoverageCurve, n_experts: int, top_k: int, tokens_eff: float, streams: int,
                   stream_overlap: float) -> np.ndarray:
    """log P(expert i is routed by none of the step's tokens), per expert, hottest first.

    The coverage curve describes one stream over time. Other streams (other prompts) agree with it only in part: their
    tokens route by the mixture stream_overlap x popularity + (1 - stream_overlap) x uniform, which is what makes the
    union of a batch grow faster than the union of one long stream.
    """
    p = _popularity(curve, n_experts)
    q = np.minimum(1.0 - 1e-12, top_k * p)
    out = tokens_eff * np.log1p(-q)
    if streams > 1:
        qb = np.minimum(1.0 - 1e-12, top_k * (stream_overlap * p + (1.0 - stream_overlap) / n_experts))
        out = out + tokens_eff * (streams - 1) * np.log1p(-qb)
    return out


def expected_union(curve: CoverageCurve, n_experts: int, top_k: int, tokens_eff: float, streams: int = 1,
                   stream_overlap: float = 1.0) -> float:
    """Expected distinct experts one layer reads for `streams` x `tokens_eff` tokens (not k x tokens)."""
    lu = _log_untouched(curve, n_experts, top_k, tokens_eff, streams, stream_overlap)
    return float(np.sum(-np.expm1(lu)))


def _cold_weights(n_experts: int, cached_share: float) -> np.ndarray:
    """Fraction of each expert (hottest first) that is NOT cached; fractional at the boundary."""
    n_cached = min(max(cached_share, 0.0), 1.0) * n_experts
    return np.clip(np.arange(1, n_experts + 1) - n_cached, 0.0, 1.0)


def expected_union_hot(curve: CoverageCurve, n_experts: int, top_k: int, tokens_eff: float, share: float,
                       streams: int = 1, stream_overlap: float = 1.0) -> float:
    """Expected distinct experts of the hottest `share` that one layer reads (e.g. served by the FP4 reserve)."""
    lu = _log_untouched(curve, n_experts, top_k, tokens_eff, streams, stream_overlap)
    hot = 1.0 - _cold_weights(n_experts, share)
    return float(np.sum(hot * -np.expm1(lu)))


def bb_zero_prob(n: float, mu: float, rho: float) -> float:
    """P(no miss among n routings) when misses are beta-binomial with mean mu and intra-class correlation rho."""
    if n <= 0 or mu <= 0:
        return 1.0
    if mu >= 1:
        return 0.0
    if rho <= 0:
        return (1.0 - mu) ** n
    s = (1.0 - rho) / rho  # alpha + beta, with alpha = mu * s
    beta = (1.0 - mu) * s
    # B(alpha, beta + n) / B(alpha, beta), written with alpha + beta = s
    return math.exp(math.lgamma(beta + n) + math.lgamma(s) - math.lgamma(beta) - math.lgamma(s + n))


@dataclass(frozen=True)
class MissStats:
    token_hit_rate: float
    misses_per_layer: float  # expected distinct experts fetched per MoE layer per step
    misses_per_step: float  # all MoE layers
    p_layer_miss: float  # P(a given layer has >= 1 miss this step), correlated model
    p_step_miss: float  # P(step has >= 1 miss), correlated model
    p_step_miss_independent: float  # the same under independence, for comparison
    layers_with_miss: float  # expected layers that wait for a fetch


def miss_stats(curve: CoverageCurve, n_experts: int, top_k: int, moe_layers: int, tokens_eff: float,
               cached_share: float, rho: float, streams: int = 1, stream_overlap: float = 1.0) -> MissStats:
    """Misses per step when the hottest `cached_share` of every layer's experts is cached on the GPU."""
    cold = _cold_weights(n_experts, cached_share)
    lu = _log_untouched(curve, n_experts, top_k, tokens_eff, streams, stream_overlap)
    miss_per_layer = float(np.sum(cold * -np.expm1(lu)))
    log_p0 = float(np.sum(cold * lu))  # log P(no cold expert touched in a layer), independent model
    hit = curve(cached_share)
    n_layer = tokens_eff * streams * top_k
    if miss_per_layer <= 1e-12 or n_layer <= 0:
        return MissStats(hit, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    # Per-routing miss probability that reproduces the independent zero-miss probability of a layer; the
    # beta-binomial keeps that mean and adds the correlation.
    mu = -math.expm1(log_p0 / n_layer)
    p_layer = 1.0 - bb_zero_prob(n_layer, mu, rho)
    p_step = 1.0 - bb_zero_prob(n_layer * moe_layers, mu, rho)
    p_step_ind = -math.expm1(log_p0 * moe_layers)
    return MissStats(
        token_hit_rate=hit,
        misses_per_layer=miss_per_layer,
        misses_per_step=miss_per_layer * moe_layers,
        p_layer_miss=p_layer,
        p_step_miss=p_step,
        p_step_miss_independent=p_step_ind,
        layers_with_miss=p_layer * moe_layers,
    )
