"""shardflow.torch against PyTorch itself, under `shardflow run --nproc-per-node N python3
check_ddp.py STORE` (N = 2, 3). Each rank also joins a torch.distributed Gloo group (a FileStore at
STORE) and trains the same model on the same batches with PyTorch DDP + AdamW, and DDP +
ZeroRedundancyOptimizer(AdamW); after 10 steps every rank's parameters must equal PyTorch's within
1e-5 relative (the same sums in another order: measured ~1e-7):
- ZeRO 0, 1, 2 in each overlap mode, forward prefetch at 1 and 2, torch.optim at stage 0;
- no_sync accumulation, a frozen parameter (it never moves), two param groups with a schedule;
- uneven inputs under join() (rank r has r batches fewer; PyTorch's DDP join averaging over the
  ranks still training); find_unused_parameters with heads the ranks take in turn and one no rank
  uses (it never moves);
- the training state: state_dict() after 5 steps loaded into a fresh model at another stage, and a
  sharded checkpoint, both going on to step 10 as if never stopped;
- PyTorch's documented loop with only the wrapper changed: a torch.optim AdamW, Adam or SGD built
  before wrapping, a StepLR on it, opt.zero_grad / opt.step / scheduler.step, at stages 0-2 = DDP's;
  another optimizer, amsgrad=True, an optimizer that stepped, a closure, a dict opt.load_state_dict() cannot take (or one rank's sharded part) refused;
- clip_grad_norm= at stages 0-2 = DDP + torch.nn.utils.clip_grad_norm_ + AdamW (the clip engaged);
  accumulation by DDP's require_backward_grad_sync attribute = DDP's;
- bad arguments are refused naming the argument, and a forward after backward without step(); an
  error in backward's hooks is a RuntimeError from loss.backward(); torch's clip_grad_norm_ where
  .grad is not the averaged gradient (stages 1-2, or before step()) raises, naming clip_grad_norm=;
  with forward prefetch it still returns each step's own norm; an enabled GradScaler on a model whose
  optimizer steps inside shardflow is refused by name.
Exit 77 (skipped) without python3-torch."""
import os
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
except ImportError:
    sys.exit(77)
import shardflow.torch as sft

ROWS, STEPS, LR, CLIP = 12, 10, 1e-2, 0.05
F = torch.nn.functional


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


class Branchy(torch.nn.Module):
    """A trunk and two heads, each step one head a rank (which ranks use which head changes), and
    a head no rank ever uses: what find_unused_parameters is for."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b, self.never = torch.nn.Linear(6, 12), torch.nn.Linear(12, 3), torch.nn.Linear(12, 3), torch.nn.Linear(12, 3)
        self.which = 0

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return (self.a if self.which == 0 else self.b)(h)


def model_for(seed, branchy):
    if not branchy:
        return model(seed)
    torch.manual_seed(seed)
    return Branchy()


def batches(rank, world, uneven=False):
    """This rank's share of each global batch (the same draws on every rank)."""
    torch.manual_seed(1000)
    share = ROWS // world
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(ROWS, 6), torch.randn(ROWS, 3)
        out.append((x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
    return out[:STEPS - rank] if uneven else out


def schedule(step):
    return LR * (0.5 if step >= STEPS // 2 else 1.0)


def loss_of(m, x, y, accumulate, no_sync):
    """One step's backward: two micro-batches with `accumulate`, the first inside no_sync()."""
    if not accumulate:
        F.mse_loss(m(x), y).backward()
        return
    half = len(x) // 2
    if accumulate == "flag":  # DDP's attribute, set per micro-step as nanoGPT-style scripts do
        m.require_backward_grad_sync = False
        (F.mse_loss(m(x[:half]), y[:half]) * half / len(x)).backward()
        m.require_backward_grad_sync = True
        (F.mse_loss(m(x[half:]), y[half:]) * (len(x) - half) / len(x)).backward()
        return
    with no_sync():
        (F.mse_loss(m(x[:half]), y[:half]) * half / len(x)).backward()
    (F.mse_loss(m(x[half:]), y[half:]) * (len(x) - half) / len(x)).backward()


def pytorch(rank, world, zero=False, accumulate=False, frozen=False, groups=False, uneven=False, branchy=False, clip=None):
    """What PyTorch's own DDP computes: rank 0's weights, DDP + AdamW (or ZeroRedundancyOptimizer)."""
    m = model_for(1, branchy)
    if frozen:
        m[0].bias.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(m, find_unused_parameters=branchy)
    trainable = [p for p in m.parameters() if p.requires_grad]
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, lr=LR)
    elif groups:
        opt = torch.optim.AdamW([{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    else:
        opt = torch.optim.AdamW(trainable, lr=LR)
    with ddp.join(enable=uneven, divide_by_initial_world_size=False):
        for step, (x, y) in enumerate(batches(rank, world, uneven)):
            if groups:
                for g in opt.param_groups:
                    g["lr"] = schedule(step)
            m.which = (step + rank) % 2
            opt.zero_grad(set_to_none=True)  # a head no rank used keeps grad None: AdamW skips it
            loss_of(ddp, x, y, accumulate, ddp.no_sync)
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            opt.step()
    return m


def train(ddp, rank, world, steps, accumulate=False, groups=False, uneven=False, opt=None):
    for step, (x, y) in enumerate(batches(rank, world, uneven)):
        if step not in steps:
            continue
        if groups:
            for g in ddp.param_groups:
                g["lr"] = schedule(step)
        ddp.module.which = (step + rank) % 2
        ddp.zero_grad()
        loss_of(ddp, x, y, accumulate, ddp.no_sync)
        ddp.step()
        if opt:
            opt.step()


def shardflow(rank, world, accumulate=False, frozen=False, groups=False, uneven=False, own_optimizer=False, branchy=False, **kwargs):
    m = model_for(rank + 1, branchy)  # apart from rank 0's: the wrapper must make them one
    if frozen:
        m[0].bias.requires_grad_(False)
    if groups:
        kwargs["optimizer"] = ("adamw", {"lr": LR}, [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                                     {"params": [n for n, p in m.named_parameters() if p.dim() < 2], "weight_decay": 0.0}])
    ddp = sft.DistributedDataParallel(m, uneven_inputs=uneven, find_unused_parameters=branchy, **kwargs)
    assert len(list(ddp.parameters())) == len(list(m.parameters())) and ddp.train() is m  # the module's, through the wrapper
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR) if own_optimizer else None
    if uneven:
        with ddp.join():
            train(ddp, rank, world, range(STEPS), accumulate, groups, uneven, opt)
    else:
        train(ddp, rank, world, range(STEPS), accumulate, groups, uneven, opt)
    ddp.wait_all_params()
    return m


def documented_loop(rank, world, opt_class, stage=None, **opt_kwargs):
    """PyTorch's DDP loop as its documentation writes it: the optimizer built on the module, a
    scheduler on the optimizer; with `stage`, shardflow's wrapper instead of torch's."""
    m = model(1 if stage is None else rank + 1)
    opt = opt_class(m.parameters(), lr=LR, **opt_kwargs)
    if stage is None:
        ddp = torch.nn.parallel.DistributedDataParallel(m)
    else:
        ddp = sft.DistributedDataParallel(m, zero_stage=stage, optimizer=opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=STEPS // 2, gamma=0.5)
    for x, y in batches(rank, world):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        scheduler.step()
    if stage is not None:
        ddp.wait_all_params()
    return m


def resumed(rank, world, how, workdir):
    """5 steps at ZeRO-1, the state saved `how`, a fresh model (other weights) at ZeRO-2 loads it
    and runs steps 5-9."""
    adamw = ("adamw", {"lr": LR})
    first = sft.DistributedDataParallel(model(rank + 1), zero_stage=1, optimizer=adamw)
    train(first, rank, world, range(5))
    path = os.path.join(workdir, "sharded")
    state = first.state_dict(to=None) if how == "state_dict" else first.save_sharded_checkpoint(path)
    m = model(rank + 7)
    second = sft.DistributedDataParallel(m, zero_stage=2, optimizer=adamw)
    if how == "state_dict":
        second.load_state_dict(state)
    else:
        second.load_checkpoint(path)
    if second.optimizer_steps != 5:
        raise AssertionError("resumed at optimizer step %d, not 5" % second.optimizer_steps)
    train(second, rank, world, range(5, STEPS))
    second.wait_all_params()
    return m


def clip_norms(rank, world, prefetch):
    """What torch's clip_grad_norm_ returns at each step on a model that clips inside its step."""
    ddp = sft.DistributedDataParallel(model(rank + 1), zero_stage=1, optimizer=("adamw", {"lr": LR}), clip_grad_norm=CLIP,
                                      forward_prefetch=prefetch)
    norms = []
    for x, y in batches(rank, world):
        ddp.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP).item())
        ddp.step()
    ddp.wait_all_params()
    return norms


def worst(got, want):
    return max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got.parameters(), want.parameters()))


def main():
    rank, world = sft.init(timeout=60)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=world)
    adamw = ("adamw", {"lr": LR})
    cases = [("ZeRO-0 interleaved = DDP + AdamW", {}, {}, dict(zero_stage=0, optimizer=adamw)),
             ("ZeRO-0, torch.optim.AdamW on .grad = DDP + AdamW", {"own_optimizer": True}, {}, dict(zero_stage=0))]
    for stage in (1, 2):
        for overlap in ("none", "after_backward", "interleaved"):
            cases.append(("ZeRO-%d %s = DDP + ZeroRedundancyOptimizer" % (stage, overlap), {}, {"zero": True},
                          dict(zero_stage=stage, overlap=overlap, optimizer=adamw)))
        cases.append(("ZeRO-%d forward prefetch = DDP + ZeroRedundancyOptimizer" % stage, {}, {"zero": True},
                      dict(zero_stage=stage, forward_prefetch=True, optimizer=adamw)))
    cases += [("ZeRO-1, no_sync of two micro-batches = DDP's no_sync", {"accumulate": True}, {"accumulate": True}, dict(zero_stage=1, optimizer=adamw)),
              ("ZeRO-1, a frozen bias = DDP + ZeroRedundancyOptimizer", {"frozen": True}, {"zero": True, "frozen": True}, dict(zero_stage=1, optimizer=adamw)),
              ("ZeRO-2, two param groups, lr halved at step 5", {"groups": True}, {"groups": True}, dict(zero_stage=2)),
              ("ZeRO-1, uneven inputs under join() = DDP's join", {"uneven": True}, {"uneven": True}, dict(zero_stage=1, optimizer=adamw)),
              ("ZeRO-1, find_unused_parameters = DDP's", {"branchy": True}, {"branchy": True, "zero": True}, dict(zero_stage=1, optimizer=adamw)),
              ("ZeRO-0, find_unused_parameters = DDP's", {"branchy": True}, {"branchy": True}, dict(zero_stage=0, optimizer=adamw)),
              ("ZeRO-0, require_backward_grad_sync accumulation = DDP's", {"accumulate": "flag"}, {"accumulate": "flag"},
               dict(zero_stage=0, optimizer=adamw))]
    for stage in (0, 1, 2):
        cases.append(("ZeRO-%d clip_grad_norm=%g = DDP + clip_grad_norm_ + AdamW" % (stage, CLIP), {}, {"clip": CLIP},
                      dict(zero_stage=stage, optimizer=adamw, clip_grad_norm=CLIP)))
    failed = 0

    def report(name, err):
        nonlocal failed
        ok = err <= 1e-5
        failed += not ok
        print("rank %d of %d: %-62s max relative error %.2e %s" % (rank, world, name, err, "ok" if ok else "FAIL"), flush=True)

    for name, ours, theirs, kwargs in cases:
        got = shardflow(rank, world, **ours, **kwargs)
        report(name, worst(got, pytorch(rank, world, **theirs)))
        if ours.get("frozen") and not torch.equal(got[0].bias, model(1)[0].bias):
            failed += 1
            print("rank %d: the frozen bias moved" % rank)
        if ours.get("branchy") and not torch.equal(got.never.weight, model_for(1, True).never.weight):
            failed += 1
            print("rank %d: the head no rank used moved" % rank)
    for stage, opt_class, kwargs in ((0, torch.optim.AdamW, {"weight_decay": 0.05}), (1, torch.optim.AdamW, {"weight_decay": 0.05}),
                                     (2, torch.optim.AdamW, {"weight_decay": 0.05}), (1, torch.optim.SGD, {"momentum": 0.9}),
                                     (2, torch.optim.Adam, {"betas": (0.8, 0.99)})):
        report("ZeRO-%d, torch.optim.%s + StepLR as documented = DDP's" % (stage, opt_class.__name__),
               worst(documented_loop(rank, world, opt_class, stage, **kwargs), documented_loop(rank, world, opt_class, **kwargs)))
    if worst(pytorch(rank, world, clip=CLIP), pytorch(rank, world)) < 1e-3:  # else the clip cases test nothing
        failed += 1
        print("rank %d: clipping at %g changed nothing: the clip cases do not test it" % (rank, CLIP))
    with tempfile.TemporaryDirectory() as scratch:
        workdir = os.path.join(os.path.dirname(sys.argv[1]), "ckpt")  # one directory for every rank
        want = pytorch(rank, world, zero=True)
        report("state_dict() at step 5 into ZeRO-2, on to step 10", worst(resumed(rank, world, "state_dict", scratch), want))
        report("sharded checkpoint at step 5 into ZeRO-2, on to step 10", worst(resumed(rank, world, "sharded", workdir), want))

    def refused(action, error, want, what):
        """1 unless action() raises `error` with `want` in its message."""
        try:
            action()
        except error as e:
            if want in str(e):
                return 0
            print("rank %d: %s: %r does not say %r" % (rank, what, str(e), want))
            return 1
        print("rank %d: %s was accepted" % (rank, what))
        return 1

    def joined(**kwargs):
        with sft.DistributedDataParallel(model(0), **kwargs).join():
            pass

    for bad, want in ((dict(overlap="sometimes"), "overlap 'sometimes'"), (dict(zero_stage=3, optimizer=adamw), "zero_stage must be 0, 1 or 2"),
                      (dict(zero_stage=1, optimizer=("lamb", {})), "optimizer 'lamb'"), (dict(zero_stage=1), "needs optimizer="),
                      (dict(zero_stage=0, optimizer=("adamw", {"momentum": 0.9})), "not momentum"),
                      (dict(zero_stage=1, optimizer=("adamw", {"lr": "fast"})), "'lr' must be a number"),
                      (dict(zero_stage=1, optimizer=("adamw", {}, [{"params": [torch.zeros(2)]}])), "group 0 holds a tensor"),
                      (dict(zero_stage=1, optimizer=("adamw", {}, [{"params": ["nope.weight"]}])), "nope.weight"),
                      (dict(snapshot_every=5), "without snapshot_dir"), (dict(snapshot_dir="snaps", snapshot_every=0), "snapshot_every must be"),
                      (dict(zero_stage=1, optimizer=adamw, redundancy=2), "redundancy = 2 heals a lost rank from memory"),
                      (dict(zero_stage=1, optimizer=adamw, redundancy=3), "redundancy must be 1 or 2"),
                      (dict(zero_stage=1, optimizer=adamw, twin_distance=1), "twin_distance = 1 places twins, but redundancy = 1")):
        failed += refused(lambda: sft.DistributedDataParallel(model(0), **bad), ValueError, want, bad)  # UsageError is a ValueError
    failed += refused(lambda: joined(zero_stage=1, optimizer=adamw), ValueError, "uneven_inputs=True", "join() without uneven_inputs")
    # DDP's loop forgets nothing but the step: a forward after an unended synchronised backward
    # is refused rather than silently folded into the next step.
    ddp = sft.DistributedDataParallel(model(0), zero_stage=1, optimizer=adamw)
    x, y = batches(rank, world)[0]
    F.mse_loss(ddp(x), y).backward()
    failed += refused(lambda: ddp(x), ValueError, "without model.step()", "a forward after backward without step()")
    ddp.step()
    # An error inside backward's readiness hooks surfaces from loss.backward() as torch's
    # RuntimeError with shardflow's message; the pass still ends with step().
    ddp = sft.DistributedDataParallel(model(0), zero_stage=1, optimizer=adamw)
    loss = F.mse_loss(ddp(x), y)
    loss.backward(retain_graph=True)
    failed += refused(loss.backward, RuntimeError, "marked ready twice", "a second backward through one graph")
    ddp.step()
    # Note [Clipping that cannot be lost]: torch's clip where .grad is not the averaged gradient.
    clip = torch.nn.utils.clip_grad_norm_
    for stage in (1, 2):
        ddp = sft.DistributedDataParallel(model(0), zero_stage=stage, optimizer=adamw)
        F.mse_loss(ddp(x), y).backward()
        failed += refused(lambda: clip(ddp.parameters(), 1.0), ValueError, "clip_grad_norm=C", "torch's clip at stage %d" % stage)
        ddp.step()
    # With clip_grad_norm= on the model, the script's own clip_grad_norm_ asking for that clip ends the
    # step (tests/python/documented_ddp.py checks the numbers); any other clip is refused by name.
    ddp = sft.DistributedDataParallel(model(0), zero_stage=1, optimizer=adamw, clip_grad_norm=1.0)
    F.mse_loss(ddp(x), y).backward()
    first_layer = list(ddp.parameters())[:1]
    for action, want, what in ((lambda: clip(ddp.parameters(), 0.5), "clips at max_norm=1.0", "another max_norm"),
                               (lambda: clip(ddp.parameters(), 1.0, norm_type=1.0), "norm_type=2.0", "another norm type"),
                               (lambda: clip(first_layer, 1.0), "a part of the model", "part of the parameters"),
                               (lambda: clip(ddp.parameters(), 1.0, error_if_nonfinite=True), "error_if_nonfinite", "error_if_nonfinite=True")):
        failed += refused(action, ValueError, want, "torch's clip on a model that clips: %s" % what)
    norm = clip(ddp.parameters(), 1.0)
    if not (torch.is_tensor(norm) and abs(norm.item() - ddp.last_grad_norm) < 1e-6 and norm.item() > 0):
        failed += 1
        print("rank %d: the model's own clip returned %r, its norm is %r" % (rank, norm, ddp.last_grad_norm))
    ddp.step()  # ended by the clip already: nothing left to do
    # Note [What the last step left, under prefetch]: with forward prefetch the step's wait returns
    # before the norm is in; the clip must still return this step's norm, not the step before's.
    plain, prefetched = clip_norms(rank, world, False), clip_norms(rank, world, True)
    if max(abs(a - b) / b for a, b in zip(prefetched, plain)) > 1e-5 or len(set(plain)) < 2:
        failed += 1
        print("rank %d: torch's clip under forward prefetch returned the norms %r, without it %r" % (rank, prefetched, plain))
    failed += refused(lambda: clip(ddp.parameters(), 1.0), ValueError, "outside the step's backward pass", "the clip again after step()")
    ddp = sft.DistributedDataParallel(model(0))
    F.mse_loss(ddp(x), y).backward()
    failed += refused(lambda: torch.nn.utils.clip_grad_value_(ddp.parameters(), 1.0), ValueError, "call model.step() first",
                      "torch's clip before step() at stage 0")
    ddp.step()
    clip(ddp.parameters(), 1.0)  # after step(): .grad is the averaged gradient, torch's clip is right
    failed += refused(lambda: sft.DistributedDataParallel(model(0), clip_grad_norm=1.0), ValueError, "there is none",
                      "clip_grad_norm= without optimizer=")
    # Note [A loss scale that cannot be lost]: an enabled GradScaler on a model whose optimizer steps
    # inside shardflow is refused by name (torch 1.13 disables it without CUDA: forced on here, the
    # refusal comes before torch's CUDA code); a disabled one passes through.
    m = model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    ddp = sft.DistributedDataParallel(m, zero_stage=1, optimizer=opt)
    scaler = torch.cuda.amp.GradScaler(enabled=False)
    scaler.scale(F.mse_loss(ddp(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    scaler._enabled = True
    failed += refused(lambda: scaler.scale(F.mse_loss(ddp(x), y)), ValueError, "GradScaler.scale", "an enabled GradScaler's scale()")
    for name, call in (("GradScaler.unscale_", lambda: scaler.unscale_(opt)), ("GradScaler.step", lambda: scaler.step(opt))):
        failed += refused(call, ValueError, name, "an enabled GradScaler's %s on shardflow's optimizer" % name)
    # torch.optim's own defaults passed along in the tuple form are accepted; another value is refused by name.
    sft.DistributedDataParallel(model(0), zero_stage=1, optimizer=("adamw", {"lr": LR, "amsgrad": False, "foreach": None}))
    failed += refused(lambda: sft.DistributedDataParallel(model(0), zero_stage=1, optimizer=("adam", {"amsgrad": True})), ValueError,
                      "amsgrad=True is not supported", "amsgrad=True in the tuple form")
    # torch.optim instances shardflow does not step as torch would, and what it does not do yet.
    m = model(0)
    for opt, want in ((torch.optim.RMSprop(m.parameters()), "RMSprop is not one"),
                      (torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad=True is not supported")):
        failed += refused(lambda: sft.DistributedDataParallel(m, zero_stage=1, optimizer=opt), ValueError, want, want)
    stepped = torch.optim.AdamW(m.parameters())
    F.mse_loss(m(x), y).backward()
    stepped.step()
    failed += refused(lambda: sft.DistributedDataParallel(m, zero_stage=1, optimizer=stepped), ValueError, "stepped already",
                      "an optimizer that stepped")
    m = model(0)
    opt = torch.optim.AdamW(m.parameters())
    ddp = sft.DistributedDataParallel(m, zero_stage=1, optimizer=opt)
    # torch's optimizer format (Note [torch's optimizer format]): a dict it cannot take as it is, refused by name.
    good = {"state": {}, "param_groups": [dict(opt.param_groups[0], params=list(range(len(list(m.parameters())))))]}
    for bad, want, what in (({"param_groups": []}, "expected torch.optim's format", "a dict without 'state'"),
                            (dict(good, param_groups=good["param_groups"] * 2), "2 param group(s)", "another number of groups"),
                            (dict(good, state={0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(1),
                                                   "exp_avg_sq": torch.zeros(1)}}), "has shape (1,)", "a moment of the wrong shape"),
                            (dict(good, state={0: {"momentum_buffer": torch.zeros(1)}}), "'momentum_buffer'", "SGD's state into AdamW"),
                            (dict(good, state={0: {"max_exp_avg_sq": torch.zeros(1)}}), "'max_exp_avg_sq'", "amsgrad's state")):
        failed += refused(lambda: opt.load_state_dict(bad), ValueError, want, "opt.load_state_dict(%s)" % what)
    # The sharded form: one rank's part alone is not the state.
    mine = opt.state_dict(sharded=True)
    failed += refused(lambda: opt.load_state_dict(mine), ValueError, "pass every rank's", "one rank's sharded dict")
    failed += refused(lambda: sft.consolidate_optimizer_state([mine]), ValueError, "missing", "consolidate without every rank")
    failed += refused(lambda: opt.state_dict(to=1, sharded=True), ValueError, "`to` names a recipient", "state_dict(to=1, sharded=True)")
    # Every setting a user can make on the wrapper or the optimizer works or raises (no silent no-op).
    for name in sft._DDP_ATTRIBUTES:
        failed += refused(lambda: setattr(ddp, name, None), ValueError, repr(name), "setting DDP's %s" % name)
    for key, value, want in (("amsgrad", True, "amsgrad=True"), ("momentum", 0.9, "'momentum' is not"), ("nesterov", True, "nesterov=True")):
        failed += refused(lambda: opt.param_groups[0].__setitem__(key, value), ValueError, want, "opt.param_groups[0][%r]" % key)
    opt.param_groups[0]["lr"] = 0.5  # works: shardflow's group takes it
    opt.param_groups[0]["initial_lr"] = 0.5  # a scheduler's bookkeeping: kept
    if ddp.param_groups[0]["lr"] != 0.5:
        failed += 1
        print("rank %d: opt.param_groups[0]['lr'] = 0.5 did not reach shardflow's group" % rank)
    F.mse_loss(ddp(x), y).backward()
    failed += refused(lambda: opt.step(lambda: 0.0), ValueError, "closure", "step(closure)")
    opt.step()
    # DDP's surface: device_ids for a CPU module refused by name, an attribute set that would do nothing refused.
    sft.DistributedDataParallel(model(0), device_ids=None, output_device=None)
    failed += refused(lambda: sft.DistributedDataParallel(model(0), device_ids=[0]), ValueError, "device_ids=[0]", "device_ids only for a CUDA module")

    def set_attr():
        ddp.gradient_as_bucket_view = False
    failed += refused(set_attr, ValueError, "'gradient_as_bucket_view'", "a DDP attribute shardflow does not take")
    # state_dict() on rank 0 only, as a script may write it for a plain module: the error says that
    # every rank calls it; the other ranks' step fails with the mismatch, not a hang.
    ddp = sft.DistributedDataParallel(model(0), zero_stage=1, optimizer=adamw)
    if rank == 0:
        failed += refused(ddp.state_dict, (sft.MismatchError, sft.TimeoutError), "every rank calls it", "state_dict() on rank 0 only")
    else:
        F.mse_loss(ddp(x), y).backward()
        failed += refused(ddp.step, (sft.MismatchError, sft.TimeoutError, sft.CommError), "", "a step while rank 0 gathers state")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
