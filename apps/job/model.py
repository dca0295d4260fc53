"""The main job's model: a small Kimi-K3-like MoE layer stack, in a MoonEP and a plain-EP build.

    x_sD -> [ x = x + MoE_l(RMSNorm_l(x)) ] for l = 1..L -> RMSNorm -> out_sD
    loss = sum over this rank's tokens of |out - target|^2 / (T * D)   (T = tokens of all ranks,
           so the ranks' losses add up to the global mean squared error)

Each MoE layer: sigmoid router with renormalised top-K weights (Kimi K2/K3 style), routed
SwiGLU experts and one shared SwiGLU expert.  The MoonEP build uses ``MoonEPMoE`` over one
``Buffer``, the baseline ``AllToAllEPMoE`` (moonep_ops/testing/baseline.py); both are loaded from
the same full weights (``full_weights``), each rank keeping its home experts, so the two builds
compute the same function.

Routing.  The job sweeps a *controlled* router imbalance: ``ForcedRouter`` keeps the router's
scores (and so its gradient through the route weights) but takes the expert ids from a
synthetic routing with a given maxvio (``moonep_ops.testing.routing_for_maxvio``).  A learned
top-K router cannot reach maxvio > E/K - 1 (each token picks an expert at most once); the
synthetic "hot" routing lets the hottest expert appear several times in one token, which both
layers (and the dense reference) handle as independent entries.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from moonep_ops.testing.baseline import AllToAllEPMoE
from moonep_ops.buffer import Buffer
from moonep_ops.nn.moe import MoonEPMoE
from moonep_ops.nn.router import Router
from moonep_ops.testing import routing_for_maxvio

# Kimi K2's router: sigmoid scores, top-K renormalised, scaled (route_scale 2.827 in K2).
ROUTER_KW = dict(score_func="sigmoid", route_norm=True, route_scale=2.827)


class ForcedRouter(nn.Module):
    """A ``Router`` whose expert choice is set from outside (the ``ids`` buffer, [s, K] int32).

    Returns what ``Router.forward`` returns: (ids, route weights gathered from the router's own
    scores and post-processed as the router would, scores)."""

    def __init__(self, router: Router, s: int, device=None):
        super().__init__()
        self.inner = router
        self.register_buffer("ids", torch.zeros(s, router.K, dtype=torch.int32, device=device),
                             persistent=False)

    @property
    def K(self) -> int:
        return self.inner.K

    def forward(self, x_sD: Tensor):
        r = self.inner
        logits_sE = r.logits(x_sD)
        ids = self.ids
        w = r.scores(logits_sE).gather(1, ids.long())
        if r.route_norm:
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        return ids, w * r.route_scale, logits_sE

    def update_balance(self, scores_TE: Tensor) -> None:   # the routing is imposed: no QB step
        pass


class MoEStack(nn.Module):
    def __init__(self, layers: list[nn.Module], D: int, dtype: torch.dtype, device):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norms = nn.ModuleList(nn.RMSNorm(D, dtype=dtype, device=device) for _ in layers)
        self.out_norm = nn.RMSNorm(D, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.out_norm(x)

    def set_routing(self, ids_per_layer: list[Tensor]) -> None:
        with torch.no_grad():
            for layer, ids in zip(self.layers, ids_per_layer):
                layer.router.ids.copy_(ids)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds in full (data parallel): all but the routed experts."""
        experts = {id(p) for layer in self.layers for p in (layer.w1, layer.w3, layer.w2)}
        return [p for p in self.parameters() if id(p) not in experts]

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in (layer.w1, layer.w3, layer.w2)]


def full_weights(L: int, E: int, D: int, F: int, seed: int) -> list[dict]:
    """Every layer's full (all-expert) weights, fp32, CPU, from one seed: same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        out.append(dict(
            gate=torch.randn(E, D, generator=g) * D ** -0.5,
            w1=torch.randn(E, F, D, generator=g) * D ** -0.5,
            w3=torch.randn(E, F, D, generator=g) * D ** -0.5,
            w2=torch.randn(E, D, F, generator=g) * F ** -0.5 * 0.5,
            s1=torch.randn(F, D, generator=g) * D ** -0.5,
            s3=torch.randn(F, D, generator=g) * D ** -0.5,
            s2=torch.randn(D, F, generator=g) * F ** -0.5 * 0.5,
        ))
    return out


def load_weights(model: MoEStack, weights: list[dict], rank: int) -> None:
    with torch.no_grad():
        for layer, w in zip(model.layers, weights):
            B = layer.w1.shape[0]           # this rank's home experts
            sl = slice(rank * B, (rank + 1) * B)
            layer.router.inner.gate.weight.copy_(w["gate"])
            layer.w1.copy_(w["w1"][sl])
            layer.w3.copy_(w["w3"][sl])
            layer.w2.copy_(w["w2"][sl])
            layer.shared.w1.weight.copy_(w["s1"])
            layer.shared.w3.weight.copy_(w["s3"])
            layer.shared.w2.weight.copy_(w["s2"])
        for n in list(model.norms) + [model.out_norm]:
            n.weight.fill_(1.0)


def build_model(kind: str, *, L: int, E: int, K: int, D: int, F: int, s: int, dtype: torch.dtype,
                device: torch.device, group=None, buffer: Optional[Buffer] = None) -> MoEStack:
    """kind "moonep" (needs ``buffer``) or "baseline"; one shared expert per layer.  The
    baseline pads its expert segments like the Buffer (``buffer.token_padding``) when given."""
    tp = buffer.token_padding if buffer is not None else 1
    layers = []
    for _ in range(L):
        if kind == "moonep":
            layer = MoonEPMoE.for_buffer(buffer, F, num_shared_experts=1, side_stream=False,
                                         **ROUTER_KW)
        elif kind == "baseline":
            layer = AllToAllEPMoE(D, F, E, K, group=group, num_shared_experts=1, dtype=dtype,
                                  device=device, token_padding=tp, **ROUTER_KW)
        else:
            raise ValueError(f"unknown model kind {kind!r}")
        layer.router = ForcedRouter(layer.router, s, device=device)
        layers.append(layer)
    return MoEStack(layers, D, dtype, device)


def step_routing(maxvio: float, step: int, layer: int, R: int, E: int, s: int, K: int,
                 seed: int) -> list[Tensor]:
    """Every rank's [s, K] int32 ids of one (step, layer): a fresh draw with the target maxvio."""
    return routing_for_maxvio(maxvio, R, E, s, K, seed=seed * 100003 + step * 101 + layer)


def batch(step: int, rank: int, s: int, D: int, seed: int, dtype, device) -> tuple[Tensor, Tensor]:
    """(x [s, D], target [s, D]) of one rank and step; the target is a fixed random teacher."""
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    teacher = torch.randn(D, D, generator=g) * D ** -0.5
    g.manual_seed((seed * 1000003 + step) * 4099 + rank)
    x = torch.randn(s, D, generator=g)
    y = x + torch.tanh(x @ teacher)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=torch.float32)
