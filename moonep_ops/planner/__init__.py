"""The MoonEP planner: from the gathered token histogram to every token copy's slot
(docs/planner.md: algorithm, theorem, policies, device planner).

  greedy.py     steps 1-2 by MoonEP's greedy rules (rank quotas, expert chunks); policy "lean"
  cost.py       policy "cost": caps with slack, the candidate plans and their predicted cost
  reference.py  the whole group's plan (steps 1-3) and one rank's slots (step 4), any device
  checks.py     argument and value checks
  op.py         the op moonep::plan and the Python API: plan, plan_all_ranks, Plan
  device.py     the device planner's bindings (csrc/plan_kernels.cu) and the backends' entry

Policies: "moonep" (bit-exact with upstream MoonEP), "lean" (exact caps, fewest replicas) and
"cost" (a cap slack, moves chosen by a predicted cost; without slack it plans as "moonep").
"""
from .cost import COST_LEVELS, level_quotas, plan_scores
from .device import (COST_DEVICE_MAX_B, COST_DEVICE_MAX_R, DEVICE_POLICIES, allocate,
                     cost_device_limit, device_planner_available, plan_from_host_rows,
                     plan_from_rows, plan_into, plan_on_device)
from .greedy import rank_quotas, replication_cost, split_quotas, split_quotas_batched
from .op import GroupResult, Plan, decode_raw_dst, make_plan, plan, plan_all_ranks
from .reference import POLICIES, GroupPlan, plan_group

__all__ = ["POLICIES", "Plan", "decode_raw_dst", "make_plan", "plan", "GroupResult", "GroupPlan", "plan_all_ranks", "plan_group",
           "replication_cost", "rank_quotas", "split_quotas", "split_quotas_batched",
           "COST_LEVELS", "level_quotas", "plan_scores", "DEVICE_POLICIES", "COST_DEVICE_MAX_R",
           "COST_DEVICE_MAX_B", "cost_device_limit", "device_planner_available", "allocate",
           "plan_into", "plan_on_device", "plan_from_rows", "plan_from_host_rows"]
