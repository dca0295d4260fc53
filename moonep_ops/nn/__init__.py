"""Modules: the MoonEP MoE layer, its router, and the plain all-to-all EP baseline."""
from .baseline import AllToAllEPMoE
from .moe import MoonEPMoE, SwiGLU
from .router import Router

__all__ = ["MoonEPMoE", "SwiGLU", "Router", "AllToAllEPMoE"]
