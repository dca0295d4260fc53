"""Modules: the MoonEP MoE layer and its arguments, routers, and the plain all-to-all EP baseline."""
from .baseline import AllToAllEPMoE
from .moe import MoEArgs, MoonEPMoE, SwiGLU, bind_moe, moe_layers
from .router import Router

__all__ = ["MoEArgs", "MoonEPMoE", "SwiGLU", "bind_moe", "moe_layers", "Router", "AllToAllEPMoE"]
