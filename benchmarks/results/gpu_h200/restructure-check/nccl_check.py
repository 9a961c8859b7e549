"""One rank on NCCL (cuda): the one all-reduce's mean and the SyncReplicas all-reduce exchange on
CUDA tensors equal the same computed on the CPU (sparse rows divided by their senders)."""

import os

import torch
import torch.distributed as dist

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.transport.all_reduce import collective_device, mean_gradients

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
print("collective device:", collective_device())
torch.manual_seed(0)
for dev in ("cuda", "cpu"):
    ps = [torch.randn(6, 3, device=dev), torch.randn(4, device=dev)]
    rows = torch.sparse_coo_tensor([[1, 1, 4]], torch.ones(3, 3, device=dev), (6, 3))
    gs = [rows, torch.ones(4, device=dev)]
    means, sent = mean_gradients(ps, gs)
    dense = [m.to_dense().cpu().tolist() if m.is_sparse else m.cpu().tolist() for m in means]
    print(dev, dense, sent)
res = {}
for dev in ("cuda", "cpu"):
    torch.manual_seed(1)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(dev)
    lin = torch.nn.Linear(4, 1).to(dev)
    params = list(emb.parameters()) + list(lin.parameters())
    opt = SyncReplicasOptimizer(gradfleet.AdamOptimizer(params, learning_rate=0.1), 1, 1)
    print(dev, "exchange:", type(opt.exchange).__name__)
    for _ in range(3):
        opt.zero_grad()
        ids = torch.tensor([[1, 2, 2], [3, 1, 0]], device=dev)
        lin(emb(ids)).pow(2).mean().backward()
        opt.step()
    res[dev] = [p.detach().cpu() for p in params]
    opt.close()
for a, b in zip(res["cuda"], res["cpu"]):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("NCCL CHECK OK")
dist.destroy_process_group()
