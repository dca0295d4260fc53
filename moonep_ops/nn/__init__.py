"""Modules: the MoonEP MoE layer and its arguments, and the router."""
from .moe import MoEArgs, MoonEPMoE, SwiGLU, bind_moe, moe_layers
from .router import Router

__all__ = ["MoEArgs", "MoonEPMoE", "SwiGLU", "bind_moe", "moe_layers", "Router"]
