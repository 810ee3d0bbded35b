"""shardflow for PyTorch in Python: data parallelism with ZeRO-1/2 and overlapped reductions,
through the same runtime as the C++ trainers (shardflow/libtorch.hpp).

    import shardflow.torch as sft
    rank, world = sft.init()                      # under `shardflow run` or torchrun
    model = sft.DistributedDataParallel(module, zero_stage=1, optimizer=("adamw", {"lr": 1e-3}))
    for x, y in batches:
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.step()                              # reduced over the ranks, stepped, synced

Rank 0's parameters and buffers are every rank's once the model is wrapped. Without `optimizer`
(zero_stage 0 only) `step()` leaves the averaged gradients in each `.grad` for a torch.optim
optimizer of your own.
"""
import contextlib

import torch  # noqa: F401  (loads libtorch before the native half)

from shardflow import _C

Error = _C.Error
UsageError = _C.UsageError
TimeoutError = _C.TimeoutError
MismatchError = _C.MismatchError
CommError = _C.CommError

_OVERLAPS = ("none", "after_backward", "interleaved")


def init(timeout=300.0, backend="auto"):
    """Joins the job's ranks (`shardflow run`'s or torchrun's environment; alone, a world of 1).
    Returns (rank, world_size). `timeout`: seconds any wait on another rank may take."""
    global _timeout
    _timeout = float(timeout)
    return _C.init(_timeout, backend)


_timeout = 300.0


def _optimizer(spec):
    """("adamw", {"lr": 1e-3, ...}) or "adamw": torch's defaults for what is not given."""
    if spec is None:
        return None
    kind, args = (spec, {}) if isinstance(spec, str) else spec
    return _C.optimizer_config(kind, dict(args))


class DistributedDataParallel:
    """`module` trained data-parallel: call it as the module, run `loss.backward()`, then `step()`.

    zero_stage: 0 (every rank steps everything), 1 (each rank keeps its shard of the optimizer
    state), 2 (and of the reduced gradients). overlap: when the reductions, steps and parameter
    syncs run against backward ("none", "after_backward", "interleaved"; default interleaved with
    an optimizer). bucket_cap_mb: the
    gradient buckets' size. optimizer: ("sgd" | "adam" | "adamw", {"lr": ..., ...}) steps inside
    shardflow; None (zero_stage 0 only) leaves the averaged gradients in .grad."""

    def __init__(self, module, zero_stage=0, overlap=None, forward_prefetch=False, bucket_cap_mb=25.0, optimizer=None):
        if not isinstance(module, torch.nn.Module):
            raise UsageError("shardflow.torch.DistributedDataParallel: module must be a torch.nn.Module, got %s" % type(module).__name__)
        if overlap is None:  # interleaved where shardflow steps; nothing to overlap where it does not
            overlap = "interleaved" if optimizer is not None else ""
        elif overlap not in _OVERLAPS:
            raise UsageError("shardflow.torch.DistributedDataParallel: overlap %r is not one of %s" % (overlap, ", ".join(_OVERLAPS)))
        if forward_prefetch:
            raise UsageError("shardflow.torch.DistributedDataParallel: forward_prefetch is not in the Python module yet "
                             "(the C++ adapter has it: shardflow/libtorch.hpp)")
        if zero_stage != 0 and optimizer is None:
            raise UsageError("shardflow.torch.DistributedDataParallel: zero_stage %d shards the optimizer, so it needs "
                             "optimizer=(kind, {...}) to step inside shardflow" % zero_stage)
        self.module = module
        self._ddp = _C.DataParallel(list(module.named_parameters()), list(module.named_buffers()), int(zero_stage), overlap,
                                    float(bucket_cap_mb), _timeout, _optimizer(optimizer))
        self._ddp.zero_grad()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self):
        """Zeroes the gradient buckets; each parameter's .grad views its slot in one."""
        self._ddp.zero_grad()

    def step(self):
        """After loss.backward(): returns once the gradients are averaged over the ranks and, with
        the optimizer, the parameters stepped and synced. The GIL is released while it waits."""
        self._ddp.after_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally; the first step() after it reduces them all."""
        self._ddp.set_require_sync(False)
        try:
            yield
        finally:
            self._ddp.set_require_sync(True)

    def wait_all_params(self):
        """Returns once every parameter holds its last update (before reading them all)."""
        self._ddp.wait_all_params()

    @property
    def rank(self):
        return self._ddp.rank()

    @property
    def world_size(self):
        return self._ddp.world_size()
