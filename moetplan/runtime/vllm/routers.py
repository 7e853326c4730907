"""Routers that replace a model's own expert choice (`RuntimeKnobs.router`).

`LocalityRouter` picks each token's top-k so that every expert's share of one layer's routings is the plan's
`router_popularity` (the model's published coverage curve, the curve the cost model predicts hit rates from), with
a per-layer random ranking of which expert is how hot. A token's k experts are distinct and drawn by systematic
sampling: the experts lie on a line in a fixed random order, expert i taking an interval of length
pi_i = k x share_i (capped at 1, the excess spread over the others); one uniform u per token selects the experts
under u, u+1, ..., u+k-1. Each expert is then chosen with probability exactly pi_i.

Tokens are independent (no temporal locality beyond the popularity): hit rates follow the curve, zero-miss
steps are those of the independent model. The uniforms come from a counter hashed on the device (no generator
state, no host sync): capture-safe, and the same on every TP rank.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from moetplan.contract.errors import ConfigError
from moetplan.contract.runtime import RuntimeKnobs
from moetplan.contract.vocab import ROUTERS

_CAP = 1.0 - 1e-4  # an interval of length exactly 1 could take two of a token's k points through rounding
_M64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed value torch's int64 holds."""
    return c - (1 << 64) if c >= 1 << 63 else c


_G, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplications wrap, as in uint64)."""
    z = x + _G
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def inclusion_probs(shares: Sequence[float], top_k: int) -> np.ndarray:
    """pi_i = top_k x share_i, capped below 1 with the excess spread over the uncapped experts (sum = top_k)."""
    p = np.asarray(shares, dtype=np.float64)
    if p.ndim != 1 or len(p) < top_k or not np.all(p >= 0) or p.sum() <= 0:
        raise ConfigError(f"router popularity must be {top_k} or more non-negative shares; got {len(p)} values")
    pi = top_k * p / p.sum()
    for _ in range(len(pi)):
        over = pi > _CAP
        if not over.any():
            break
        free = ~over & (pi < _CAP)
        excess = float(np.sum(pi[over] - _CAP))
        pi[over] = _CAP
        if not free.any() or pi[free].sum() <= 0:
            pi[free] += excess / max(1, int(free.sum()))
        else:
            pi[free] += excess * pi[free] / pi[free].sum()
    return pi


class LocalityRouter:
    """Expert ids per token whose per-layer popularity is `shares` (hottest first)."""

    def __init__(self, shares: Sequence[float], top_k: int, seed: int = 0):
        self.num_experts, self.top_k, self.seed = len(shares), int(top_k), int(seed)
        self.pi = inclusion_probs(shares, self.top_k)  # hottest first
        self._layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._counters: dict[str, torch.Tensor] = {}

    def ranking(self, layer: int) -> np.ndarray:
        """Expert ids of `layer`, hottest first (a random ranking per layer, fixed by the seed)."""
        return np.random.default_rng([self.seed, layer, 0]).permutation(self.num_experts)

    def expected_share(self, layer: int) -> np.ndarray:
        """Each expert's expected share of the layer's routings, by expert id."""
        out = np.empty(self.num_experts)
        out[self.ranking(layer)] = self.pi / self.top_k
        return out

    def _tables(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, str(device))
        if key not in self._layers:
            ranking = self.ranking(layer)
            line = np.random.default_rng([self.seed, layer, 1]).permutation(self.num_experts)  # positions on the line
            pi_by_id = np.empty(self.num_experts)
            pi_by_id[ranking] = self.pi
            cum = np.cumsum(pi_by_id[line])
            self._layers[key] = (torch.tensor(cum, dtype=torch.float64, device=device),
                                 torch.tensor(line, dtype=torch.int64, device=device))
        return self._layers[key]

    def _uniforms(self, layer: int, n: int, device: torch.device) -> torch.Tensor:
        dev = str(device)
        if dev not in self._counters:
            self._counters[dev] = torch.zeros((), dtype=torch.int64, device=device)
        counter = self._counters[dev]
        idx = counter + torch.arange(n, dtype=torch.int64, device=device)
        counter.add_(n)  # on the device: a captured graph advances it on every replay
        h = splitmix64(idx * 131 + (self.seed * 1_000_003 + layer))
        return _shr(h, 11).to(torch.float64) * (1.0 / (1 << 53))

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The draw counters as they stand (device copies, no host read): a step run again (the replay driver)
        restores them so it draws what its first run drew."""
        return {dev: c.clone() for dev, c in self._counters.items()}

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        for dev, c in snap.items():
            self._counters[dev].copy_(c)  # in place: captured graphs hold the counter's address

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """New ids [T, k] (same dtype and device as the model's); the model's weights are kept."""
        n, k = topk_ids.shape
        if k != self.top_k:
            raise ConfigError(f"locality router built for top-{self.top_k}, the layer routes top-{k}")
        device = topk_ids.device
        cum, line = self._tables(layer, device)
        u = self._uniforms(layer, n, device)
        targets = u[:, None] + torch.arange(k, dtype=torch.float64, device=device)[None, :]
        pos = torch.searchsorted(cum, targets, right=True).clamp_(max=self.num_experts - 1)
        return line[pos].to(topk_ids.dtype)


def router_for(knobs: RuntimeKnobs, top_k: int) -> LocalityRouter | None:
    """The router the runtime knobs ask for (None: the model's own)."""
    kind = knobs.router
    if kind == "model":
        return None
    if kind == "locality":
        shares = knobs.router_popularity
        if not shares:
            raise ConfigError("the plan's router is 'locality' but it carries no router_popularity; re-run "
                              "`moetplan run --router locality`, which fills it from the model's coverage curve")
        return LocalityRouter(shares, top_k, knobs.seed)
    raise ConfigError(f"router '{kind}' is not one the runtime has ({', '.join(ROUTERS)})")


__all__ = ["LocalityRouter", "inclusion_probs", "router_for", "splitmix64"]
