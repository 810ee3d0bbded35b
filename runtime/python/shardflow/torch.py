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
import functools
import gc
import itertools
import json
import os
import pickle
import weakref

import torch  # noqa: F401  (loads libtorch before the native half)

from shardflow import _C, _optim

Error = _C.Error
UsageError = _C.UsageError
TimeoutError = _C.TimeoutError
MismatchError = _C.MismatchError
CommError = _C.CommError
# Every rank's optimizer.state_dict(sharded=True) as one dict in torch.optim's format.
consolidate_optimizer_state = _optim.consolidate

_OVERLAPS = ("none", "after_backward", "interleaved")

# Note [Clipping that cannot be lost]
# With the optimizer inside shardflow (zero_stage 1 or 2, or optimizer= at 0) a parameter's .grad
# is not the averaged gradient a clip would need when the user's code runs: at stage 2 it is None
# once its bucket is reduced, at stage 1 it views bucket memory the runtime is still reducing and
# stepping, so torch.nn.utils.clip_grad_norm_ between loss.backward() and step() either clips
# nothing or races with the step (measured: runs that diverged). Without that optimizer, .grad
# holds the averaged gradient only after step(). So torch's clip functions are wrapped: called on a
# wrapped model's parameters where .grad is not that gradient, they raise and say what to do;
# elsewhere they are torch's own. The clip that works with the step inside backward is
# DistributedDataParallel(clip_grad_norm=C): the exact global norm over every rank's shard, as
# torch.nn.utils.clip_grad_norm_ computes it over the whole model (coefficient C / (norm + 1e-6)).
# With it set, the script's own torch.nn.utils.clip_grad_norm_(model.parameters(), C) between
# loss.backward() and optimizer.step() stays: asking for the clip the step already does, over the
# whole model, it ends the step there and returns the global norm before clipping, as torch's does;
# the optimizer.step() after it has nothing left to do. Any other clip on those parameters (another
# C or norm type, a part of the model, error_if_nonfinite=True, which would have to stop a step
# already taken) is refused by name.
_live = weakref.WeakSet()  # the wrappers alive in this process

# PyTorch DDP's public attributes that this wrapper does not take after construction: setting one
# would otherwise land on the wrapper and change nothing. require_backward_grad_sync is honoured.
_DDP_ATTRIBUTES = ("broadcast_bucket_size", "broadcast_buffers", "bucket_bytes_cap", "device", "device_ids", "device_type", "dim",
                   "find_unused_parameters", "gradient_as_bucket_view", "is_multi_device_module", "logger", "modules_buffers",
                   "named_module_buffers", "num_iterations", "output_device", "parameters_to_ignore", "process_group", "reducer",
                   "require_forward_param_sync", "static_graph", "use_side_stream_for_tensor_copies")


def _guard_clip(torch_fn, name):
    @functools.wraps(torch_fn)
    def clip(parameters, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for ddp in list(_live):
            if ids & ddp._param_ids:
                if name.endswith("clip_grad_norm_") and ddp._clip is not None:
                    return ddp._clip_in_step(name, ids, *args, **kwargs)
                ddp._check_grads_readable(name)
        return torch_fn(parameters, *args, **kwargs)
    clip._shardflow_guard = True
    return clip


for _module in (torch.nn.utils, torch.nn.utils.clip_grad):
    for _name in ("clip_grad_norm_", "clip_grad_value_"):
        if not getattr(getattr(_module, _name), "_shardflow_guard", False):
            setattr(_module, _name, _guard_clip(getattr(_module, _name), "torch.nn.utils." + _name))


# Note [A loss scale that cannot be lost]
# An enabled torch.cuda.amp.GradScaler multiplies the loss, and its unscale_() / step(optimizer)
# divide the .grad the optimizer reads, skipping the step on an inf. A model whose optimizer steps
# inside shardflow reads the reduced buckets instead, during and right after backward: it would step
# the scaled gradients as they are, overflowed ones included, without a word. Loss scaling from
# Python is not there yet (the C++ runtime's own, Config::precision.dynamic_loss_scale, is not
# exposed), so an enabled scaler is refused by name at scale() while such a model is alive (before
# the scaled backward reaches the runtime), and at unscale_() / step() on such a model's optimizer.
# A disabled scaler (torch 1.13 turns itself off without CUDA) passes through, as does an enabled
# one beside models whose .grad the user's own optimizer reads (zero_stage 0 without optimizer=).
def _refuse_scaler(what):
    raise UsageError("%s: an enabled torch.cuda.amp.GradScaler on a shardflow.torch model whose optimizer steps inside shardflow "
                     "(optimizer=, or zero_stage 1-2): the step reads the reduced gradients, not .grad, so the loss scale would never "
                     "be undone and overflowed steps would be taken. fp16 loss scaling from Python is not supported yet: train in bf16 "
                     "(torch.autocast(dtype=torch.bfloat16)) without a scaler, or pass GradScaler(enabled=False)" % what)


def _guard_scaler(torch_fn, name, takes_optimizer):
    @functools.wraps(torch_fn)
    def guarded(scaler, *args, **kwargs):
        if scaler.is_enabled():
            if takes_optimizer:
                optimizer = args[0] if args else kwargs.get("optimizer")
                ids = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in (g.get("params", ()) if hasattr(g, "get") else ())}
                if any(ids & ddp._param_ids and ddp._in_runtime for ddp in list(_live)):
                    _refuse_scaler(name)
            elif any(ddp._in_runtime for ddp in list(_live)):
                _refuse_scaler(name)
        return torch_fn(scaler, *args, **kwargs)
    guarded._shardflow_guard = True
    return guarded


for _name, _takes_optimizer in (("scale", False), ("unscale_", True), ("step", True)):
    if not getattr(getattr(torch.cuda.amp.GradScaler, _name), "_shardflow_guard", False):
        setattr(torch.cuda.amp.GradScaler, _name,
                _guard_scaler(getattr(torch.cuda.amp.GradScaler, _name), "GradScaler." + _name, _takes_optimizer))


def init(timeout=300.0, backend="auto"):
    """Joins the job's ranks (`shardflow run`'s or torchrun's environment; alone, a world of 1).
    Returns (rank, world_size). `timeout`: seconds any wait on another rank may take."""
    global _timeout
    _timeout = float(timeout)
    return _C.init(_timeout, backend)


_timeout = 300.0


def _whole(name, value):
    """A whole-number argument as the runtime takes it; its range is the runtime's to check, by this name."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError("shardflow.torch.DistributedDataParallel: %s must be a whole number, got %r" % (name, value))
    return value


def _module_device(module):
    """The one device a module's parameters and buffers live on (CPU or one GPU), or UsageError."""
    devices = {t.device for t in itertools.chain(module.parameters(), module.buffers())}
    if len(devices) > 1:
        raise UsageError("shardflow.torch.DistributedDataParallel: the module's tensors are on %s; shardflow trains a module that "
                         "lives on one device (move it with module.to(device) first)" % ", ".join(sorted(str(d) for d in devices)))
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError("shardflow.torch.DistributedDataParallel: the module is on %s; shardflow trains CPU and CUDA tensors" % device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_device_args(device, device_ids, output_device):
    """DDP's device arguments: a CPU module takes none (as PyTorch's DDP requires); a CUDA module
    takes None or its own device, [i] / i / torch.device (one GPU per process)."""
    def index_of(value):
        if isinstance(value, torch.device):
            return value.index if value.type == "cuda" else None
        return int(value) if isinstance(value, int) else None
    for arg, value in (("device_ids", device_ids), ("output_device", output_device)):
        if value is None or (arg == "device_ids" and len(value) == 0):
            continue
        if device.type != "cuda":
            raise UsageError("shardflow.torch.DistributedDataParallel: %s=%r: the module's parameters are on %s, and DDP takes "
                             "%s only for a CUDA module; leave %s=None" % (arg, value, device, arg, arg))
        given = list(value) if arg == "device_ids" else [value]
        if len(given) != 1 or index_of(given[0]) != device.index:
            raise UsageError("shardflow.torch.DistributedDataParallel: %s=%r, but the module is on %s: pass [%d] (one GPU per "
                             "process, the module's own) or leave it None" % (arg, value, device, device.index))


def _groups(spec, module):
    """The optimizer as [(OptimizerConfig, [parameter names])]: ("adamw", {"lr": 1e-3, ...}), "adamw",
    or ("adamw", {defaults}, [{"params": [...], "weight_decay": 0.0, ...}, ...]) as torch.optim's
    param groups (tensors of the module, or their names); a parameter no group names joins group 0.
    torch's defaults for what is not given."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = (spec, {})
    if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3) or not isinstance(spec[1], dict):
        raise UsageError("shardflow.torch.DistributedDataParallel: optimizer must be (kind, {hyper-parameters}[, [param groups]]), got %r" % (spec,))
    kind, defaults = spec[0], _optim.strip_neutral(spec[1], "the defaults")
    if len(spec) == 2:
        return [(_C.optimizer_config(kind, dict(defaults)), [])]
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for i, group in enumerate(spec[2]):
        group = dict(group)
        if "params" not in group:
            raise UsageError("shardflow.torch.DistributedDataParallel: optimizer param group %d has no 'params'" % i)
        params = group.pop("params")
        params = [params] if isinstance(params, (str, torch.Tensor)) else list(params)
        chosen = []
        for p in params:
            if isinstance(p, str):
                chosen.append(p)
            elif id(p) in names:
                chosen.append(names[id(p)])
            else:
                raise UsageError("shardflow.torch.DistributedDataParallel: optimizer param group %d holds a tensor of shape %s "
                                 "that is none of the module's parameters" % (i, tuple(p.shape)))
        hyper = dict(defaults)
        hyper.update(_optim.strip_neutral(group, "param group %d" % i))
        groups.append((_C.optimizer_config(kind, hyper), chosen))
    return groups


class ParamGroup(dict):
    """One of model.param_groups: its hyper-parameters as torch.optim shows them; setting one
    (a schedule's g["lr"] = ...) takes effect from the next step."""

    def __init__(self, ddp, index):
        super().__init__(ddp.hyperparameters(index))
        self._ddp, self._index = ddp, index

    def __setitem__(self, key, value):
        self._ddp.set_hyperparameters(self._index, {key: value})
        super().__setitem__(key, value)


class DistributedDataParallel:
    """`module` trained data-parallel: call it as the module, run `loss.backward()`, then `step()`.

    zero_stage: 0 (every rank steps everything), 1 (each rank keeps its shard of the optimizer
    state), 2 (and of the reduced gradients). overlap: when the reductions, steps and parameter
    syncs run against backward ("none", "after_backward", "interleaved"; default interleaved with
    an optimizer). forward_prefetch: step() returns before the parameter syncs land, and each
    submodule's forward waits for its own parameters (stages 1-2). bucket_cap_mb: the gradient
    buckets' size in MiB, used as given, as DDP's (None: 25, shrunk so that a small model still gets
    four buckets to overlap, sixteen at zero_stage 1 or 2 over several ranks). optimizer: a
    torch.optim.SGD, Adam or AdamW (its groups and hyper-parameters become shardflow's, and it
    drives the run: opt.step(), opt.zero_grad(), opt.param_groups[i]["lr"] and lr schedulers on
    it), or ("sgd" | "adam" | "adamw", {"lr": ..., ...}[, param groups]): steps
    inside shardflow; None (zero_stage 0 only) leaves the averaged gradients in .grad for a
    torch.optim optimizer. uneven_inputs: ranks may run out of data at different steps (train
    inside `with model.join():`). find_unused_parameters, static_graph, broadcast_buffers: as
    DDP's (parameters forward did not use are reduced as zeros, and not stepped where no rank used
    them; a graph that never changes, re-entrant backward included; rank 0's buffers everywhere
    each step). trace: a Chrome trace of each rank's timeline ("{rank}" in the path, else one file
    per rank beside it). clip_grad_norm, clip_norm_type (2.0 or inf): clip as
    torch.nn.utils.clip_grad_norm_ clips the whole model, inside shardflow's optimizer step with
    the exact global norm (needs optimizer=); torch's own clip functions raise where .grad is not
    the averaged gradient (Note [Clipping that cannot be lost]). require_backward_grad_sync: DDP's
    attribute; False accumulates the next backward passes locally, as inside no_sync().
    snapshot_dir, snapshot_every: every `snapshot_every` steps each rank snapshots its shard of the
    model and optimizer state in the background (under `shardflow run` into memory that outlives
    the ranks, now and then into snapshot_dir); resumed_step() goes on from the newest after a
    restart, recover() after a lost peer without restarting this process. redundancy=2 (zero_stage
    1 or 2, snapshot_dir set) keeps a twin of each rank's optimizer shard on another rank
    (twin_distance ranks on; 0: a node's worth when there are several nodes, else 1), so that
    recover() goes on after the last step every survivor finished, from memory, with no step
    rolled back (Note [Mirrored shards]); it costs a shard's state again per rank, a slice per
    bucket on the link and the twin's step. What snapshot_with() names is then kept at every step."""

    def __init__(self, module, zero_stage=0, overlap=None, forward_prefetch=False, bucket_cap_mb=None, optimizer=None,
                 uneven_inputs=False, find_unused_parameters=False, static_graph=False, broadcast_buffers=True, trace=None,
                 clip_grad_norm=None, clip_norm_type=2.0, device_ids=None, output_device=None, snapshot_dir=None, snapshot_every=1,
                 redundancy=1, twin_distance=0):
        if not isinstance(module, torch.nn.Module):
            raise UsageError("shardflow.torch.DistributedDataParallel: module must be a torch.nn.Module, got %s" % type(module).__name__)
        device = _module_device(module)
        if not _C.initialized():  # init() is optional: the launcher's environment (torchrun, shardflow run, Slurm, mpirun) says the rest
            _C.init(_timeout, "auto", device.index if device.type == "cuda" else -1)
        torch_optimizer = None
        if isinstance(optimizer, torch.optim.Optimizer):  # the optimizer as PyTorch users build it (shardflow/_optim.py)
            torch_optimizer, optimizer = optimizer, _optim.spec_of(optimizer)
        if overlap is None:  # interleaved where shardflow steps; nothing to overlap where it does not
            overlap = "interleaved" if optimizer is not None else ""
        elif overlap not in _OVERLAPS:
            raise UsageError("shardflow.torch.DistributedDataParallel: overlap %r is not one of %s" % (overlap, ", ".join(_OVERLAPS)))
        if zero_stage != 0 and optimizer is None:
            raise UsageError("shardflow.torch.DistributedDataParallel: zero_stage %d shards the optimizer, so it needs "
                             "optimizer=(kind, {...}) to step inside shardflow" % zero_stage)
        _check_device_args(device, device_ids, output_device)
        if clip_grad_norm is not None and optimizer is None:
            raise UsageError("shardflow.torch.DistributedDataParallel: clip_grad_norm=%r clips inside shardflow's optimizer step, and "
                             "there is none: pass optimizer=(kind, {...}), or clip with torch.nn.utils.clip_grad_norm_ after "
                             "model.step(), when .grad holds the averaged gradient" % (clip_grad_norm,))
        if snapshot_dir is None and snapshot_every != 1:
            raise UsageError("shardflow.torch.DistributedDataParallel: snapshot_every=%r without snapshot_dir: no snapshot would be "
                             "taken; pass snapshot_dir= too" % (snapshot_every,))
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise UsageError("shardflow.torch.DistributedDataParallel: snapshot_every must be a whole number of steps >= 1, got %r"
                             % (snapshot_every,))
        self.module = module
        self._clip = None if clip_grad_norm is None else (float(clip_grad_norm), float(clip_norm_type))
        self._clipped_step = False  # torch's clip_grad_norm_ ended this pass (Note [Clipping that cannot be lost])
        self._in_runtime = optimizer is not None
        self._zero_stage = int(zero_stage)
        self._param_ids = {id(p) for p in module.parameters()}
        self._device = device
        self._stream = None  # the compute stream the runtime was last told of (a CUDA module)
        self._prefetch = bool(forward_prefetch)
        self._accumulating = False
        self._uneven = bool(uneven_inputs)
        groups = _groups(optimizer, module)
        self._ddp = _C.DataParallel(list(module.named_parameters()), list(module.named_buffers()), int(zero_stage), overlap,
                                    self._prefetch, self._uneven, bool(find_unused_parameters), bool(static_graph), bool(broadcast_buffers),
                                    0.0 if bucket_cap_mb is None else float(bucket_cap_mb), _timeout, trace or "", groups,
                                    0.0 if clip_grad_norm is None else float(clip_grad_norm), float(clip_norm_type),
                                    self._current_stream(), "" if snapshot_dir is None else os.fspath(snapshot_dir), int(snapshot_every),
                                    _whole("redundancy", redundancy), _whole("twin_distance", twin_distance))
        self._ddp.zero_grad()
        _live.add(self)
        self.param_groups = [ParamGroup(self._ddp, i) for i in range(len(groups))]
        self._torch_optimizer = torch_optimizer  # an LR scheduler may wrap its step (_restore_snapshot_with)
        self._snapshots = snapshot_dir is not None
        self._snapshot_with = {}  # name -> object whose state each snapshot carries (snapshot_with())
        # The groups' hyper-parameters by the keys their kind takes ("adamw" or ("adamw", {...}); validated above).
        self._taken = () if optimizer is None else _optim.TAKEN.get(optimizer if isinstance(optimizer, str) else optimizer[0], ())
        if torch_optimizer is not None:
            _optim.adopt(torch_optimizer, self, optimizer[0])
        self._hooks = []
        if self._prefetch:
            # Each submodule that owns parameters waits for their syncs right before its forward
            # reads them, so the syncs of later blocks still land while earlier ones compute.
            for name, sub in module.named_modules():
                own = list(sub.parameters(recurse=False))
                if own:
                    self._hooks.append(sub.register_forward_pre_hook(self._waiter(own, name or type(module).__name__)))

    def _clip_in_step(self, what, ids, max_norm, norm_type=2.0, error_if_nonfinite=False, **rest):
        """Note [Clipping that cannot be lost]: torch.nn.utils.clip_grad_norm_ on this model, which clips
        inside its step: the same clip ends the step and returns the norm; any other raises."""
        max_c, type_c = self._clip
        asked = "%s(max_norm=%r, norm_type=%r)" % (what, max_norm, norm_type)
        if rest:
            raise UsageError("%s: %s not taken on a shardflow.torch model" % (asked, ", ".join(sorted(rest))))
        if float(max_norm) != max_c or float(norm_type) != type_c:
            raise UsageError("%s on a model that clips at max_norm=%r, norm_type=%r inside its step (clip_grad_norm=, clip_norm_type=): "
                             "ask for the same clip, or construct the model with this one" % (asked, max_c, type_c))
        if ids != {id(p) for p in self.module.parameters() if p.requires_grad}:
            raise UsageError("%s over a part of the model's parameters: shardflow clips the whole model inside its step "
                             "(clip_grad_norm=); pass model.parameters()" % asked)
        if error_if_nonfinite:
            raise UsageError("%s with error_if_nonfinite=True: the step is taken inside shardflow before the norm could stop it; "
                             "check model.last_grad_norm after the step instead" % asked)
        if self._accumulating or not self._ddp.grads_this_pass():
            raise UsageError("%s outside the step's backward pass (before loss.backward(), or in an accumulation pass): call it "
                             "right before optimizer.step()" % asked)
        self._ddp.after_backward()
        self._clipped_step = True
        return torch.tensor(self.last_grad_norm)

    def _check_grads_readable(self, what):
        """Note [Clipping that cannot be lost]: raises unless .grad holds the averaged gradient."""
        if self._in_runtime:
            where = ("None once its bucket is reduced" if self._zero_stage == 2 else
                     "bucket memory shardflow is still reducing and stepping")
            raise UsageError("%s on a shardflow.torch model whose optimizer steps inside shardflow (zero_stage %d): each .grad is %s, "
                             "so the clip would be lost or race with the step. Pass clip_grad_norm=C (and clip_norm_type=) to "
                             "DistributedDataParallel instead: it clips with the exact global norm inside the step"
                             % (what, self._zero_stage, where))
        if self._ddp.grads_this_pass():
            raise UsageError("%s between loss.backward() and model.step(): .grad holds this rank's own gradient until step() "
                             "averages it over the ranks; call model.step() first, then clip, then your optimizer's step()" % what)

    @property
    def require_backward_grad_sync(self):
        """DDP's attribute: False makes the following backward passes accumulate locally (as inside
        no_sync(), also across forwards); set back to True before the pass whose step() reduces."""
        return not self._accumulating

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, sync):
        sync = bool(sync)
        if sync == (not self._accumulating):
            return
        if sync:
            self._end_open_pass()  # the last local pass ends as accumulation before syncing resumes
            self._ddp.set_require_sync(True)
            self._accumulating = False
        else:
            self._ddp.set_require_sync(False)
            self._accumulating = True

    def __setattr__(self, name, value):
        if name in _DDP_ATTRIBUTES:
            raise UsageError("shardflow.torch.DistributedDataParallel: setting DDP's attribute %r would change nothing here; "
                             "pass what shardflow takes to the constructor (see help(DistributedDataParallel))" % name)
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        """What the wrapper does not define is the module's (train(), eval(), parameters(), ...),
        as on PyTorch's DDP, which is itself the module's nn.Module."""
        module = self.__dict__.get("module")
        if module is None:
            raise AttributeError(name)
        return getattr(module, name)

    def _waiter(self, params, name):
        ddp = self._ddp

        def wait(_module, _inputs):
            ddp.wait_for(params, name)
        return wait

    def _end_open_pass(self):
        """A backward pass without its step(): inside no_sync() (DDP's loop: loss.backward() per
        micro-batch, one step at the end) it is ended here as an accumulation pass."""
        if self._ddp.grads_this_pass():
            if not self._accumulating:
                raise UsageError("shardflow.torch.DistributedDataParallel: forward after loss.backward() without model.step(); "
                                 "call step() after each backward (or accumulate inside model.no_sync())")
            self._ddp.after_backward()

    def _current_stream(self):
        """A CUDA module's compute stream: torch's current stream on its device, as a cudaStream_t."""
        if self._device.type != "cuda":
            return 0
        stream = torch.cuda.current_stream(self._device).cuda_stream
        self._stream = stream
        return stream

    def __call__(self, *args, **kwargs):
        self._end_open_pass()
        if self._snapshots:
            step = self._ddp.trainer_state_wanted()
            if step:
                self._hand_snapshot_with(step)
        if self._device.type == "cuda" and torch.cuda.current_stream(self._device).cuda_stream != self._stream:
            self._ddp.set_stream(self._current_stream())  # Note [CUDA modules]: forward and backward run there
        out = self.module(*args, **kwargs)
        if self._prefetch:
            self._ddp.before_backward()  # every .grad() now views its bucket (forward waited for every sync)
        return out

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradient buckets; each parameter's .grad views its slot in one (set_to_none is
        accepted for torch's signature; the views stay, as DDP's gradient_as_bucket_view)."""
        self._ddp.zero_grad()

    def step(self):
        """After loss.backward(): returns once the gradients are averaged over the ranks and, with
        the optimizer, the parameters stepped (and synced, unless forward_prefetch leaves the syncs
        to land during the next forward). The GIL is released while it waits."""
        # An LR scheduler counts the optimizer's steps in the opt.step() it wraps, and warns on its
        # first step() that it came before the optimizer's when that count is 0: a step taken
        # through the model counts as the optimizer's (opt.step() itself comes through _step()).
        if self._torch_optimizer is not None:
            self._torch_optimizer._step_count = getattr(self._torch_optimizer, "_step_count", 0) + 1
        self._step()

    def _step(self):
        if self._clipped_step:  # torch's clip_grad_norm_ ended this pass already
            self._clipped_step = False
            return
        self._ddp.after_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally, step() or not after each; the first step()
        after the block reduces them all (as DDP's no_sync)."""
        self._ddp.set_require_sync(False)
        self._accumulating = True
        try:
            yield
            self._end_open_pass()  # the block's last backward, still unreduced
        finally:
            self._accumulating = False
            self._ddp.set_require_sync(True)

    @contextlib.contextmanager
    def join(self):
        """For ranks with uneven numbers of batches (DDP's join(); needs uneven_inputs=True): train
        inside the block; a rank whose data ran out takes part in the others' remaining steps with
        no gradient of its own (the averages count the ranks that contributed) until every rank has
        left its block."""
        if not self._uneven:
            raise UsageError("shardflow.torch.DistributedDataParallel.join: construct the model with uneven_inputs=True "
                             "(every step then counts the ranks still training)")
        yield
        self._ddp.join()

    def wait_all_params(self):
        """Returns once every parameter holds its last update (before reading them all)."""
        self._ddp.wait_all_params()

    # ---- state: the module's and the optimizer's, in parameter coordinates ---------------------
    def state_dict(self, to=0):
        """The whole training state, gathered on rank `to` (every rank with to=None; a collective:
        every rank calls it): the parameters and buffers under the module's names, the optimizer
        state as "optim.<name>.exp_avg" / "exp_avg_sq" / "momentum_buffer", and "_metadata" (step
        count, stage, the hyper-parameters it ran with). Other ranks get {}. torch.save() it;
        load_state_dict() takes it at any world size and stage. The weights alone:
        model.module.state_dict()."""
        self.wait_all_params()
        try:
            tensors, meta = self._ddp.state_dict(-1 if to is None else int(to))
        except (MismatchError, TimeoutError) as e:
            # The usual cause: a script that saves on rank 0 only (`if rank == 0: model.state_dict()`),
            # as it may for a plain module. Say so beside the precise message.
            raise type(e)("%s\nshardflow.torch: state_dict() gathers every rank's shard, so every rank calls it (rank %d gets the "
                          "state, the others {}); call it outside `if rank == 0:` and save on rank 0 only" % (e, 0 if to is None else to)) from e
        if not tensors:
            return {}
        for name, b in self.module.named_buffers():
            tensors[name] = b.detach().clone()
        tensors["_metadata"] = meta
        return tensors

    def load_state_dict(self, state):
        """state_dict()'s dict (or a module's own state_dict(): parameters and buffers alone) into
        every rank; every rank calls it with the whole dict, between steps. The step count and the
        optimizer's moments come from the dict; the hyper-parameters stay the model's own (set
        them, as a schedule does each step)."""
        self.wait_all_params()  # no parameter sync may still be landing on what is loaded
        state = dict(state)
        meta = state.pop("_metadata", {})
        buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            for name in [n for n in state if n in buffers]:
                buffers[name].copy_(state.pop(name))
        self._ddp.load_state_dict(state, {str(k): str(v) for k, v in meta.items()})
        self._refresh_groups()

    def save_checkpoint(self, path, to=0, max_file_bytes=0):
        """The state_dict() as one safetensors file (split past max_file_bytes, with an index),
        written by rank `to`; a collective. The C++ trainers and `shardflow` read the same files."""
        self._ddp.save_checkpoint(str(path), int(to), int(max_file_bytes))

    def save_sharded_checkpoint(self, directory, background=False):
        """Each rank writes its own shard to `directory` (no rank gathers anything), rank 0 the
        index last; with background=True training goes on while the files are written, and
        wait_checkpoint() (every rank) puts them on disk. A collective."""
        self._ddp.save_sharded_checkpoint(str(directory), bool(background))

    def wait_checkpoint(self):
        self._ddp.wait_checkpoint()

    def load_checkpoint(self, path):
        """A file, split files' index, or a sharded checkpoint's directory, from any world size and
        stage; every rank calls it, between steps."""
        self.wait_all_params()
        self._ddp.load_checkpoint(str(path))
        self._refresh_groups()

    # ---- snapshots and recovering from a lost peer (Note [Snapshots], Note [Recovering in place]) --
    def resumed_step(self):
        """With snapshot_dir: loads the newest complete snapshot there (the same on every rank; under
        `shardflow run` the snapshots live in memory) and returns the step it follows, 0 on a fresh
        start. Once, before the first forward: the loop goes on from there."""
        step = self._ddp.resumed_step()
        self._restore_snapshot_with(step, "resumed_step")
        return step

    def snapshot_with(self, **objects):
        """What each snapshot carries besides the model and the optimizer: objects with state_dict()
        and load_state_dict(), the same on every rank, named: model.snapshot_with(scheduler=sched)
        for an LR scheduler (torch.optim.lr_scheduler). Each snapshot keeps their state as it stands
        at the next forward, after the loop's scheduler.step(); resumed_step() and recover() give it
        back with the model's, so the schedule goes on at the snapshot's step. Call it before
        resumed_step(). Without it, a scheduler found stepping this model's optimizer makes
        resumed_step() and recover() refuse to go on from a snapshot, naming it (Note [The trainer's
        state in a snapshot])."""
        if not self._snapshots:
            raise UsageError("shardflow.torch.DistributedDataParallel.snapshot_with: no snapshots are taken (snapshot_dir is not set), "
                             "so none would carry %s" % ", ".join(sorted(objects)))
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError("shardflow.torch.DistributedDataParallel.snapshot_with: %s=%s has no state_dict() and "
                                 "load_state_dict(), so a snapshot could not carry it" % (name, type(obj).__name__))
        self._snapshot_with.update(objects)

    def _hand_snapshot_with(self, step):
        """Note [The trainer's state in a snapshot]: the snapshot of `step`, in flight, gets the state
        of what snapshot_with() names, as it stands now (the trainer's code after the step has run)."""
        # The groups' hyper-parameters too, as a scheduler set them after the step: those of the
        # next step (the snapshot's own are the step's, and recover() starts from the initial ones).
        groups = [{k: g[k] for k in self._taken} for g in self.param_groups]
        self._ddp.set_trainer_state(step, pickle.dumps({"objects": {n: o.state_dict() for n, o in self._snapshot_with.items()},
                                                        "groups": groups}))

    def _restore_snapshot_with(self, step, call):
        """After a snapshot of `step` was loaded: the groups' views show the runtime's
        hyper-parameters, and what snapshot_with() names goes back to the snapshot; a scheduler left
        out would go on from where this process left it, so that is refused."""
        blob = self._ddp.trainer_state() if step else None
        state = pickle.loads(blob) if blob is not None else None
        if state is not None:
            for i, saved in enumerate(state["groups"]):
                self._ddp.set_hyperparameters(i, saved)
        self._refresh_groups()
        if step == 0:
            return
        where = "shardflow.torch.DistributedDataParallel.%s" % call
        if not self._snapshot_with:
            fn = getattr(self._torch_optimizer, "step", None)
            if getattr(fn, "_with_counter", False) or getattr(fn, "_wrapped_by_lr_sched", False):
                raise UsageError("%s: an LR scheduler steps this model's optimizer, but the snapshots do not carry its state: it "
                                 "would go on from where this process left it while the model goes on after step %d (another "
                                 "learning rate from here on). Name it before resumed_step(): model.snapshot_with(scheduler=...)"
                                 % (where, step))
            return
        if state is None:
            raise UsageError("%s: the snapshot of step %d carries no state for %s (it completed before the next forward handed "
                             "it over: a run's last snapshot, or one another program took); remove it from the snapshot "
                             "directory to go on from the one before" % (where, step, ", ".join(sorted(self._snapshot_with))))
        objects = state["objects"]
        for name, obj in self._snapshot_with.items():
            if name not in objects:
                raise UsageError("%s: the snapshot of step %d has no state for %r (it carries %s): name the same objects in "
                                 "snapshot_with() in every run" % (where, step, name, ", ".join(sorted(objects)) or "none"))
            obj.load_state_dict(objects[name])

    def recover(self):
        """After a lost peer (a CommError or TimeoutError from step() or a collective) under `shardflow
        run --max-restarts N --recovery in-place`: this process goes on in the job's next round while
        the lost rank's process starts again (--recovery shrink: the survivors go on at the smaller
        world). Every rank discards the failed step and reloads the newest complete snapshot, the
        same one (with redundancy=2: goes on after the last step every survivor finished, from the
        twins' memory); returns the step to go on from. rank and world_size are the new round's (shard the
        data by them). Needs snapshot_dir; one model per process."""
        if len(_live) > 1:
            gc.collect()  # wrappers no longer referenced, but held in a cycle until the collector runs
        if len(_live) > 1:
            raise UsageError("shardflow.torch.DistributedDataParallel.recover: %d models are alive in this process; recover() "
                             "moves the process's one process group to the next round, so it recovers one model per process"
                             % len(_live))
        step = self._ddp.recover()
        self._clipped_step = False
        self._restore_snapshot_with(step, "recover")
        return step

    def _refresh_groups(self):
        for g in self.param_groups:
            dict.update(g, self._ddp.hyperparameters(g._index))
        # The torch optimizer's view of the same groups (a chained scheduler reads group["lr"]).
        for i, g in enumerate(getattr(self._torch_optimizer, "param_groups", ())):
            dict.update(g, {k: self.param_groups[i][k] for k in self._taken})

    # ---- what a run looks like ------------------------------------------------------------------
    @property
    def last_grad_norm(self):
        """The global gradient norm of the last step, over every rank (computed when clipping)."""
        return self._ddp.last_grad_norm()

    def stats(self):
        """Each recent step's figures and their medians (iteration, exposed communication, bytes)."""
        return json.loads(self._ddp.stats_json())

    def memory_report(self):
        return self._ddp.memory_report()

    @property
    def optimizer_steps(self):
        return self._ddp.optimizer_steps()

    @property
    def rank(self):
        return self._ddp.rank()

    @property
    def world_size(self):
        return self._ddp.world_size()
