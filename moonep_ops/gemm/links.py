"""Link constants of the planner's cost policy, kept next to the GEMM tuning constants (tuning.py).

tuning.py's constants are fitted (benchmarks/fit_gemm_cost_model.py rewrites tuning.json); these
are not, so they live here.  A Buffer user overrides the link bandwidth with
``Buffer(..., policy="cost", link_gbps=...)`` (or ``MoEArgs(link_gbps=...)``).

LINK_GBPS         GB/s (1e9 bytes/s) one GPU sends (or receives) over its NVLink, per direction.
                  H200 SXM: NVLink 4, 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s
                  bidirectional) -- A DATASHEET NUMBER, NOT MEASURED HERE YET (LINK_MEASURED).
                  What the planner assumes a replica's weight push and grad pull reach.
DEVICE_COPY_TBPS  TB/s of a device-to-device copy in HBM: measured (the calibration's HBM_TBPS,
                  4.243 TB/s on the H200).  A replica's bytes are also read and written once
                  in HBM on each side; at 4.2 TB/s against 0.45 TB/s over the link that is
                  ~10 % of the link time, and the data plane's copies overlap it, so the cost
                  model counts the link only.
"""
from __future__ import annotations

from . import tuning

LINK_GBPS = 450.0
LINK_MEASURED = False
LINK_SOURCE = ("datasheet: NVIDIA H200 SXM, NVLink 4 at 900 GB/s bidirectional = 450 GB/s per "
               "direction per GPU; not yet measured on this hardware")

DEVICE_COPY_TBPS = float(tuning.HBM_TBPS)
DEVICE_COPY_SOURCE = "measured: benchmarks/calibrate_grouped_gemm.py (tuning.HBM_TBPS)"
