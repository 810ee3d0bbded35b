"""shardflow.torch under `shardflow run --nproc-per-node N python3 check_ddp.py` (N = 2, 3): after
10 steps every rank's parameters equal PyTorch's on the whole batch (what DDP + AdamW and DDP +
ZeroRedundancyOptimizer compute: the gradient averaged over equal shares is the whole batch's),
within 1e-5 relative (the sums go in another order), at ZeRO 0, 1 and 2, with torch.optim stepping
at stage 0, with no_sync accumulation and a frozen parameter; bad arguments are refused by name.
Exit 77 (skipped) without python3-torch."""
import sys

try:
    import torch
except ImportError:
    sys.exit(77)
import shardflow.torch as sft

ROWS, STEPS, LR = 12, 10, 1e-2


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def batches():
    torch.manual_seed(1000)
    return [(torch.randn(ROWS, 6), torch.randn(ROWS, 3)) for _ in range(STEPS)]


def reference(frozen=False):
    """Rank 0's starting weights, AdamW on the whole batch: what every rank must end with."""
    m = model(1)  # rank 0's seed
    if frozen:
        m[0].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return m


def trained(rank, world, accumulate=False, frozen=False, own_optimizer=False, **kwargs):
    m = model(rank + 1)  # apart from rank 0's: the wrapper must make them one
    if frozen:
        m[0].bias.requires_grad_(False)
    ddp = sft.DistributedDataParallel(m, **kwargs)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR) if own_optimizer else None
    share = ROWS // world
    for x, y in batches():
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        ddp.zero_grad()
        if accumulate:  # two micro-batches, the first without a reduction
            half = share // 2
            with ddp.no_sync():
                (torch.nn.functional.mse_loss(ddp(x[:half]), y[:half]) * half / share).backward()
                ddp.step()
            (torch.nn.functional.mse_loss(ddp(x[half:]), y[half:]) * (share - half) / share).backward()
        else:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        ddp.step()
        if opt:
            opt.step()
    ddp.wait_all_params()
    return m


def worst(got, want):
    return max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got.parameters(), want.parameters()))


def main():
    rank, world = sft.init(timeout=60)
    adamw = ("adamw", {"lr": LR})
    cases = [("ZeRO-0, shardflow's AdamW", {}, dict(zero_stage=0, optimizer=adamw)),
             ("ZeRO-1 interleaved", {}, dict(zero_stage=1, overlap="interleaved", optimizer=adamw)),
             ("ZeRO-1 none", {}, dict(zero_stage=1, overlap="none", optimizer=adamw)),
             ("ZeRO-2 interleaved", {}, dict(zero_stage=2, overlap="interleaved", optimizer=adamw)),
             ("ZeRO-0, torch.optim.AdamW on the averaged .grad", {"own_optimizer": True}, dict(zero_stage=0)),
             ("ZeRO-1, no_sync accumulation of two micro-batches", {"accumulate": True}, dict(zero_stage=1, optimizer=adamw)),
             ("ZeRO-1, a frozen parameter", {"frozen": True}, dict(zero_stage=1, optimizer=adamw))]
    failed = 0
    for name, how, kwargs in cases:
        err = worst(trained(rank, world, **how, **kwargs), reference(frozen=how.get("frozen", False)))
        ok = err <= 1e-5
        failed += not ok
        print("rank %d of %d: %-50s max relative error %.2e %s" % (rank, world, name, err, "ok" if ok else "FAIL"), flush=True)
    frozen = trained(rank, world, frozen=True, zero_stage=1, optimizer=adamw)
    if not torch.equal(frozen[0].bias, model(1)[0].bias):
        failed += 1
        print("rank %d: the frozen bias moved" % rank)
    for bad, want in ((dict(overlap="sometimes"), "overlap 'sometimes'"), (dict(zero_stage=3, optimizer=adamw), "zero_stage must be 0, 1 or 2"),
                      (dict(zero_stage=1, optimizer=("lamb", {})), "optimizer 'lamb'"), (dict(zero_stage=1), "needs optimizer="),
                      (dict(zero_stage=0, optimizer=("adamw", {"momentum": 0.9})), "not momentum")):
        try:
            sft.DistributedDataParallel(model(0), **bad)
            failed += 1
            print("rank %d: %s was accepted" % (rank, bad))
        except ValueError as e:  # shardflow's UsageError is a ValueError
            if want not in str(e):
                failed += 1
                print("rank %d: %s: %r does not say %r" % (rank, bad, str(e), want))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
