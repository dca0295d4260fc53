"""Top CUDA kernels of one MoE layer step (forward + backward) at DeepSeek-V3 expert shapes on one GPU.

    python diagnostics/profile_moe_layer.py bf16|fp8
"""
import torch, sys
from torch.profiler import profile, ProfilerActivity
from moonep_ops import Buffer, MoonEPMoE
dev=torch.device("cuda"); T,D,F,E,K=4096,7168,2048,32,8
buf=Buffer(T,D,K,E,token_padding=128,dtype=torch.bfloat16,device=dev)
torch.manual_seed(0); layer=MoonEPMoE.for_buffer(buf,F,precision=sys.argv[1])
x=torch.randn(T,D,device=dev).bfloat16().requires_grad_()
def step():
    y=layer(x); y.float().square().mean().backward()
for _ in range(3): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(3): step()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
