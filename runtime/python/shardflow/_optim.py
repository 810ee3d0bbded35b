"""A torch.optim optimizer handed to shardflow.torch.DistributedDataParallel(optimizer=opt).

Its param groups and hyper-parameters become shardflow's, and from then on the same object drives
the run as a PyTorch user's loop drives it: opt.step() ends the step (shardflow reduces, steps its
shards inside backward and syncs), opt.zero_grad() clears the buckets, opt.param_groups[i]["lr"] = x
(and so torch.optim.lr_scheduler on it) takes effect at the next step. What shardflow does not
compute as torch would is refused by name, never ignored: another optimizer class, a key that
changes the maths (amsgrad=True, nesterov=True, dampening, maximize), an optimizer that has stepped
already, a closure, and torch's optimizer state_dict format (shardflow's model.state_dict() holds
the whole training state).
"""
import types
import weakref

import torch

from shardflow import _C

KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
TAKEN = {"sgd": ("lr", "momentum", "weight_decay"), "adam": ("lr", "betas", "eps", "weight_decay"),
         "adamw": ("lr", "betas", "eps", "weight_decay")}
# Keys whose value must be this for shardflow's step to equal torch's.
NEUTRAL = {"amsgrad": False, "nesterov": False, "dampening": 0, "maximize": False, "capturable": False, "differentiable": False}
# Keys that choose how torch computes, not what: any value.
HOW = ("foreach", "fused")
# Keys a scheduler or a user adds for their own bookkeeping.
BOOKKEEPING = ("initial_lr",)


def _refuse(what):
    raise _C.UsageError("shardflow.torch.DistributedDataParallel(optimizer=...): " + what)


def strip_neutral(hyper, where):
    """Hyper-parameters without the keys that leave the maths as shardflow computes it (amsgrad=False,
    foreach=...: torch.optim's own defaults, passed along); such a key at another value is refused."""
    out = {}
    for key, value in hyper.items():
        if key in HOW or key in BOOKKEEPING:
            continue
        if key in NEUTRAL:
            if value != NEUTRAL[key]:
                _refuse("%s: %s=%r is not supported (shardflow steps as %s=%r)" % (where, key, value, key, NEUTRAL[key]))
            continue
        out[key] = value
    return out


def spec_of(opt):
    """(kind, {}, [param groups]) for _groups(), from a torch.optim instance."""
    kind = KINDS.get(type(opt))
    if kind is None:
        _refuse("%s is not one shardflow steps (torch.optim.SGD, Adam, AdamW); pass one of those, or "
                            "optimizer=None at zero_stage 0 and step your own on .grad after model.step()" % type(opt).__name__)
    if any(len(s) for s in opt.state.values()):
        _refuse("the %s has stepped already: its state would be lost; wrap the model before the first step "
                            "(to resume, load model.state_dict() or a checkpoint)" % type(opt).__name__)
    groups = []
    for i, group in enumerate(opt.param_groups):
        hyper = {}
        for key, value in group.items():
            if key == "params" or key in HOW or key in BOOKKEEPING:
                continue
            if key in TAKEN[kind]:
                hyper[key] = value
            elif key in NEUTRAL:
                if value != NEUTRAL[key]:
                    _refuse("param group %d: %s=%r is not supported (shardflow's %s steps as %s=%r)"
                                        % (i, key, value, kind, key, NEUTRAL[key]))
            else:
                _refuse("param group %d: key %r is not one shardflow knows for %s" % (i, key, type(opt).__name__))
        groups.append(dict(hyper, params=list(group["params"])))
    return (kind, {}, groups)


class _Group(dict):
    """One of opt.param_groups once shardflow steps: its keys as torch's, a hyper-parameter set
    (a scheduler's group["lr"] = ...) reaching shardflow's group for the next step."""

    def __init__(self, group, ddp, index, taken):
        super().__init__(group)
        self._ddp, self._index, self._taken = ddp, index, taken

    def __setitem__(self, key, value):
        if key in self._taken:
            self._ddp.param_groups[self._index][key] = value
        elif key in NEUTRAL:
            if value != NEUTRAL[key]:
                _refuse("param group %d: %s=%r is not supported" % (self._index, key, value))
        elif key not in HOW and key not in BOOKKEEPING:
            # A key shardflow's step does not read (momentum on AdamW, ...): torch would ignore it
            # too, but here it may be meant for a step that never sees it.
            _refuse("param group %d: %r is not a hyper-parameter of this optimizer's step (it takes %s)"
                    % (self._index, key, ", ".join(self._taken)))
        super().__setitem__(key, value)


def _step(opt, closure=None):
    ddp = opt._shardflow_ddp()
    if closure is not None:
        _refuse("step(closure) is not supported: run the forward and backward, then step()")
    ddp.step()


def _zero_grad(opt, set_to_none=False):
    opt._shardflow_ddp().zero_grad(set_to_none)


def _state_dict(opt):
    _refuse("opt.state_dict(): torch's optimizer format is not written yet; model.state_dict() "
                                             "holds parameters and optimizer state (at any world size and stage)")


def _load_state_dict(opt, state):
    _refuse("opt.load_state_dict(): torch's optimizer format is not read yet; use "
                                             "model.load_state_dict() with what model.state_dict() saved")


def _add_param_group(opt, group):
    _refuse("opt.add_param_group(): shardflow's groups are fixed once the model is wrapped")


def adopt(opt, ddp, kind):
    """From here `opt` drives `ddp`: its methods become bound ones (as lr_scheduler expects, which
    wraps opt.step to count steps) that call the wrapper."""
    opt._shardflow_ddp = weakref.ref(ddp)
    for name, fn in (("step", _step), ("zero_grad", _zero_grad), ("state_dict", _state_dict), ("load_state_dict", _load_state_dict),
                     ("add_param_group", _add_param_group)):
        setattr(opt, name, types.MethodType(fn, opt))
    opt.param_groups = [_Group(g, ddp, i, TAKEN[kind]) for i, g in enumerate(opt.param_groups)]
