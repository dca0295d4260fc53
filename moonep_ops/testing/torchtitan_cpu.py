"""Run torchtitan 0.3.0 on a CPU-only torch over gloo: the shims the tests, CI and the example use.

Not needed, and a no-op, on a machine with CUDA (each shim is applied only where the condition it
fixes holds).  Call ``install()`` BEFORE anything imports ``torchtitan.models`` or
``torchtitan.trainer`` (``moonep_ops.integrations.torchtitan`` included), and wrap the model's
``parallelize_fn`` with ``gloo_parallelize``::

    from moonep_ops.testing import torchtitan_cpu
    torchtitan_cpu.install()                      # before torchtitan's models are imported
    import torchtitan.trainer
    spec.parallelize_fn = torchtitan_cpu.gloo_parallelize(spec.parallelize_fn)

What torchtitan 0.3.0 needs on a CPU-only torch, and what ``install`` does about it:

1. ``torchtitan.distributed.minimal_async_ep.kernels`` does ``import triton`` at module level and is
   imported by ``models/common/token_dispatcher.py`` unconditionally.  Without triton a stub of
   *that torchtitan module* is registered (a fake top-level ``triton`` would be taken for a real
   one by torch's inductor).  MinimalAsyncEP itself is CUDA-only and never runs here.
2. ``torchtitan.tools.utils.device_type`` is ``_get_available_device_type() or "cuda"``, evaluated
   at import and copied into ``parallel_dims`` (device mesh), ``distributed.utils`` (process-group
   backend), ``token_dispatcher`` and ``metrics``.  With no accelerator the probe is made to
   answer "cpu" while ``tools.utils`` imports, so every copy says "cpu" (gloo meshes).
3. ``device_module`` then is ``torch.cpu``, which lacks what the Trainer and its metrics call
   (``get_device_name``, ``get_device_properties``, ``memory_stats``, ...): every torchtitan
   module's copy is replaced by a small stand-in.
4. ``distributed.utils.set_pg_timeouts`` (the Trainer calls it after step 1) uses
   ``torch.distributed.set_timeout``, absent from CPU builds of torch 2.13: routed to
   ``distributed_c10d._set_pg_timeout``.

And ``gloo_parallelize(fn)``: torchtitan gives FSDP2 ``gradient_divide_factor=1.0`` (it divides
the loss by the global token count itself), so FSDP reduce-scatters with ``ReduceOp.PREMUL_SUM``,
which gloo rejects.  ``set_force_sum_reduction_for_comms(True)`` on every FSDP module makes it a
SUM followed by a division by 1.0: the same numbers.  Applied only to gloo process groups.

Other CPU limits of torchtitan 0.3.0 (not shimmed): the default ``spmd_backend="spmd_types"``
exchanges tokens with gloo's list all_to_all, which refuses uneven splits, so torchtitan's own EP
needs ``parallelism.spmd_backend="partial_dtensor"`` on gloo; FlexAttention (the registry's
attention) needs compiled flex kernels (use ``ScaledDotProductAttention``); DeepEP, HybridEP,
MinimalAsyncEP, Float8/MXFP8, CUDA graphs and FSDP symmetric memory are CUDA-only.
"""
from __future__ import annotations

import importlib
import os
import sys
import types

import torch

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _Unavailable:
    """What the triton-kernel stub hands out: raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchtitan's triton kernels are not available on CPU")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


def _install_kernels_stub() -> None:
    if _KERNELS in sys.modules or _has_triton():
        return
    stub = types.ModuleType(_KERNELS)
    stub.__file__ = __file__

    def __getattr__(attr):                      # PEP 562
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(attr)

    stub.__getattr__ = __getattr__
    sys.modules[_KERNELS] = stub


class _CpuDeviceModule:
    """Enough of a ``torch.cuda``-like module for torchtitan's Trainer and metrics on CPU."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device):
        pass

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 1 << 34
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def synchronize(device=None):
        pass


_CPU_DEVICE_MODULE = _CpuDeviceModule()


def _import_tools_utils_on_cpu() -> None:
    if "torchtitan.tools.utils" in sys.modules:
        return
    import torch._utils as tu

    probe = tu._get_available_device_type
    if probe() is not None:                    # an accelerator: torchtitan's own choice is right
        importlib.import_module("torchtitan.tools.utils")
        return
    tu._get_available_device_type = lambda: "cpu"
    try:
        importlib.import_module("torchtitan.tools.utils")
    finally:
        tu._get_available_device_type = probe


def _patch_set_pg_timeouts() -> None:
    import torch.distributed as dist
    import torchtitan.distributed.utils as du

    if hasattr(dist, "set_timeout") or getattr(du, "_moonep_cpu_shim", False):
        return
    from torch.distributed import distributed_c10d as c10d

    def set_pg_timeouts(timeout, parallel_dims):
        dist.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
        for g in groups + [None]:
            c10d._set_pg_timeout(timeout, g)

    du.set_pg_timeouts = set_pg_timeouts
    du._moonep_cpu_shim = True


def install(*modules: str) -> None:
    """Apply the CPU shims (idempotent), then import ``modules`` (default: torchtitan's trainer,
    the Qwen3 and DeepSeek-V3 models).  Must run before torchtitan's models are first imported."""
    _install_kernels_stub()
    _import_tools_utils_on_cpu()
    for mod in modules or ("torchtitan.trainer", "torchtitan.models.qwen3",
                           "torchtitan.models.deepseek_v3"):
        importlib.import_module(mod)
    for name, m in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(m, "device_module", None) is torch.cpu:
            m.device_module = _CPU_DEVICE_MODULE
    _patch_set_pg_timeouts()


def gloo_fsdp_sum_reduction(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 modules of ``model`` that reduce over gloo groups: SUM instead of PREMUL_SUM."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.is_initialized() and dist.get_backend() != "gloo":
        return model
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def gloo_parallelize(parallelize_fn):
    """Wrap a torchtitan ``parallelize_fn`` (same signature) with ``gloo_fsdp_sum_reduction``."""

    def parallelize(model, **kwargs):
        return gloo_fsdp_sum_reduction(parallelize_fn(model, **kwargs))

    parallelize.__name__ = f"gloo_{getattr(parallelize_fn, '__name__', 'parallelize')}"
    parallelize.__wrapped__ = parallelize_fn
    return parallelize


__all__ = ["install", "gloo_parallelize", "gloo_fsdp_sum_reduction"]
