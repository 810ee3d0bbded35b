"""PyTorch's DDP example as its documentation writes it, with one line changed (the import), under
`shardflow run --nproc-per-node N`: the script's own torch.distributed.init_process_group("gloo")
from the launcher's environment (no shardflow.torch.init()), a torch.optim optimizer handed to the
wrapper, an LR scheduler, accumulation by DDP's require_backward_grad_sync, torch.distributed used
beside it (all_reduce of a metric, barrier, destroy_process_group), and a bf16 autocast forward. In the same processes PyTorch's
own DDP trains a copy on the same group: every logged loss and the final parameters must agree
(1e-5 relative). Exit 77 (skipped) without python3-torch."""
import sys

try:
    import torch
    import torch.distributed as dist
except ImportError:
    sys.exit(77)
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from shardflow.torch import DistributedDataParallel as DDP  # the changed line

STEPS, MICRO = 8, 2


def train(wrap, zero_stage, autocast=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    ddp_model = wrap(model, optimizer, zero_stage)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(MICRO):
            ddp_model.require_backward_grad_sync = micro == MICRO - 1
            x, y = torch.randn(20, 10), torch.randn(20, 5)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # bf16 forward, fp32 parameters and gradients
                out = ddp_model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) / MICRO
            loss.backward()
            total += loss.detach()
        optimizer.step()
        scheduler.step()
        dist.all_reduce(total)  # the script's own metric, on its own process group
        losses.append(total.item() / world)
    dist.barrier()
    if hasattr(ddp_model, "wait_all_params"):
        ddp_model.wait_all_params()
    return model, losses


def main():
    dist.init_process_group("gloo")  # env:// from the launcher: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    torch_model, torch_losses = train(lambda m, opt, stage: TorchDDP(m), 0)
    failed = 0
    for stage in (0, 1, 2):
        model, losses = train(lambda m, opt, stage: DDP(m, optimizer=opt, zero_stage=stage), stage)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
        param_err = max(((a - b).norm() / b.norm()).item() for a, b in zip(model.parameters(), torch_model.parameters()))
        ok = loss_err <= 1e-5 and param_err <= 1e-5
        failed += not ok
        print("rank %d: ZeRO-%d, the documented loop with the import changed: losses within %.1e, parameters within %.1e of "
              "PyTorch DDP's %s" % (rank, stage, loss_err, param_err, "ok" if ok else "FAIL"), flush=True)
    # torch.autocast("cpu", bfloat16) around the forward, as the documentation's mixed precision.
    torch_model, torch_losses = train(lambda m, opt, stage: TorchDDP(m), 0, autocast=True)
    model, losses = train(lambda m, opt, stage: DDP(m, optimizer=opt, zero_stage=stage), 1, autocast=True)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
    param_err = max(((a - b).norm() / b.norm()).item() for a, b in zip(model.parameters(), torch_model.parameters()))
    ok = loss_err <= 1e-5 and param_err <= 1e-5
    failed += not ok
    print("rank %d: ZeRO-1, bf16 autocast forward: losses within %.1e, parameters within %.1e of PyTorch DDP's %s"
          % (rank, loss_err, param_err, "ok" if ok else "FAIL"), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
