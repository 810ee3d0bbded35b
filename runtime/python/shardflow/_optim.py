"""A torch.optim optimizer handed to shardflow.torch.DistributedDataParallel(optimizer=opt).

Its param groups and hyper-parameters become shardflow's, and from then on the same object drives
the run as a PyTorch user's loop drives it: opt.step() ends the step (shardflow reduces, steps its
shards inside backward and syncs), opt.zero_grad() clears the buckets, opt.param_groups[i]["lr"] = x
(and so torch.optim.lr_scheduler on it) takes effect at the next step. What shardflow does not
compute as torch would is refused by name, never ignored: another optimizer class, a key that
changes the maths (amsgrad=True, nesterov=True, dampening, maximize), an optimizer that has stepped
already, a closure. opt.state_dict() / opt.load_state_dict() speak torch.optim's format (Note
[torch's optimizer format]), so a checkpoint moves between shardflow and plain PyTorch either way.
"""
import json
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
# The moments each kind keeps per parameter, as torch.optim names them (Note [torch's optimizer format]).
MOMENTS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}


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
    ddp._step()  # an LR scheduler's wrapper of opt.step counted it already


def _zero_grad(opt, set_to_none=False):
    opt._shardflow_ddp().zero_grad(set_to_none)


# Note [torch's optimizer format]
# torch.optim's state_dict is {"state": {i: {...}}, "param_groups": [{hyper-parameters, "params":
# [i, ...]}]}, i numbering the parameters through the groups in order. Per parameter, Adam and AdamW
# keep "step" (a float tensor: the steps this parameter took), "exp_avg" and "exp_avg_sq"; SGD keeps
# "momentum_buffer" (None at momentum 0); a parameter that never stepped has no entry. shardflow
# keeps one step count and, per parameter, the steps it sat out (shardflow.skipped_steps): a
# parameter's own count is the difference, as Shard::step computes it, so the two forms convert
# exactly both ways. SGD's first step (the buffer starts as the gradient) is a parameter without a
# buffer in torch and one whose own count is 0 here. The moments travel in the parameter's dtype,
# as torch keeps them, and are fp32 inside shardflow.


def _param_names(opt, ddp):
    """This run's parameter names in torch's numbering (through the groups in order)."""
    by_id = {id(p): n for n, p in ddp.module.named_parameters()}
    return [by_id[id(p)] for g in opt.param_groups for p in g["params"]]


# The sharded form: each rank's own part, no collective (Runtime::shard_state_dict): torch's layout
# with each parameter's tensors holding this rank's slices of it end to end, and a "shard" entry
# saying which (offset, length) they are, the rank, the world size and every parameter's shape.
# consolidate() joins every rank's into the gathered form, which plain PyTorch loads.


def _groups_of(opt):
    groups, first = [], 0
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = list(range(first, first + len(g["params"])))
        first += len(g["params"])
        groups.append(saved)
    return groups


def _own_steps(meta):
    """name -> the steps that parameter took; 0 for a frozen one (torch keeps nothing for it)."""
    steps = int(meta.get("shardflow.steps", "0"))
    skipped = json.loads(meta.get("shardflow.skipped_steps", "{}"))
    frozen = set(json.loads(meta.get("shardflow.frozen", "[]")))
    return lambda name: 0 if name in frozen else steps - int(skipped.get(name, 0))


def _torch_entry(kind, own, moment, dtype):
    """One parameter's torch.optim state: `moment(key)` is shardflow's fp32 tensor or None."""
    entry = {} if kind == "sgd" else {"step": torch.tensor(float(own))}
    for key in MOMENTS[kind]:
        t = moment(key)
        entry[key] = None if t is None else t.to(dtype)
    return entry


def _sharded_state_dict(opt, ddp):
    tensors, meta = ddp._ddp.shard_state_dict()
    own_steps = _own_steps(meta)
    params = dict(ddp.module.named_parameters())
    offsets = {}  # parameter -> the offsets of this rank's slices of it
    for key in tensors:
        name, at = key.rsplit("@", 1)
        if name in params:
            offsets.setdefault(name, []).append(int(at))
    state, slices, shapes = {}, {}, {}
    for i, name in enumerate(_param_names(opt, ddp)):
        shapes[i] = list(params[name].shape)
        own = own_steps(name)
        if own <= 0 or name not in offsets:
            continue  # never stepped, or another rank's
        mine = sorted(offsets[name])

        def moment(key):
            parts = [tensors.get("optim.%s.%s@%d" % (name, key, o)) for o in mine]
            return None if parts[0] is None else torch.cat(parts)
        state[i] = _torch_entry(opt._shardflow_kind, own, moment, params[name].dtype)
        slices[i] = [[o, int(tensors["%s@%d" % (name, o)].numel())] for o in mine]
    return {"state": state, "param_groups": _groups_of(opt),
            "shard": {"rank": ddp.rank, "world_size": ddp.world_size, "slices": slices, "shapes": shapes}}


def consolidate(shards):
    """Every rank's opt.state_dict(sharded=True), in any order, as one dict in torch.optim's own
    format (what plain PyTorch's optimizer.load_state_dict takes)."""
    shards = list(shards)
    if not shards or not all(isinstance(d, dict) and "shard" in d for d in shards):
        _refuse("consolidate: expected every rank's opt.state_dict(sharded=True)")
    world = shards[0]["shard"]["world_size"]
    ranks = sorted(d["shard"]["rank"] for d in shards)
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        _refuse("consolidate: the dicts are of ranks %s of a world of %d%s" % (ranks, world, (": rank(s) %s missing" % missing) if missing else ""))
    shapes = {int(i): s for i, s in shards[0]["shard"]["shapes"].items()}
    state = {}
    for i in sorted({int(i) for d in shards for i in d["state"]}):
        numel = 1
        for n in shapes[i]:
            numel *= n
        entry, covered = {}, torch.zeros(numel, dtype=torch.int32)
        for d in shards:
            if i not in d["state"]:
                continue
            own = d["state"][i]
            for key, value in own.items():
                if key == "step" or value is None:
                    entry.setdefault(key, value)
                    continue
                full = entry.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                at = 0
                for offset, length in d["shard"]["slices"][i]:
                    full[offset:offset + length] = value[at:at + length]
                    at += length
            for offset, length in d["shard"]["slices"][i]:
                covered[offset:offset + length] += 1
        if not bool((covered == 1).all()):
            bad = int((covered != 1).nonzero()[0])
            _refuse("consolidate: element %d of parameter %d is in %d rank(s)' dicts, not one: dicts of different saves?"
                    % (bad, i, int(covered[bad])))
        for key, value in entry.items():
            if torch.is_tensor(value) and key != "step":
                entry[key] = value.view(shapes[i])
        state[i] = entry
    return {"state": state, "param_groups": shards[0]["param_groups"]}


def _state_dict(opt, to=0, sharded=False):
    """torch.optim's state_dict, gathered on rank `to` (every rank with to=None); the other ranks
    get {}. A collective, as model.state_dict(): every rank calls it, and saves on rank 0 only.
    sharded=True: this rank's own part, no collective (consolidate() joins every rank's)."""
    ddp = opt._shardflow_ddp()
    if sharded:
        if to != 0:
            _refuse("opt.state_dict(to=%r, sharded=True): the sharded form is each rank's own part, on that rank; "
                    "`to` names a recipient for the gathered form only" % (to,))
        return _sharded_state_dict(opt, ddp)
    try:
        full = ddp.state_dict(to)
    except (_C.MismatchError, _C.TimeoutError) as e:
        raise type(e)(str(e).replace("state_dict() gathers", "opt.state_dict() gathers", 1)) from e
    if not full:
        return {}
    own_steps = _own_steps(full["_metadata"])
    params = dict(ddp.module.named_parameters())
    state = {}
    for i, name in enumerate(_param_names(opt, ddp)):
        own = own_steps(name)
        if own > 0:  # never stepped: torch keeps nothing for it
            state[i] = _torch_entry(opt._shardflow_kind, own, lambda key: full.get("optim.%s.%s" % (name, key)), params[name].dtype)
    return {"state": state, "param_groups": _groups_of(opt)}


def _load_state_dict(opt, state_dict):
    """torch.optim's state_dict (saved by plain PyTorch or by opt.state_dict()) into the run, between
    steps; every rank calls it with the whole dict. The groups' hyper-parameters are taken from it,
    as torch's load_state_dict takes them; a key shardflow does not step by is refused by name."""
    ddp = opt._shardflow_ddp()
    if isinstance(state_dict, (list, tuple)):  # every rank's sharded form
        state_dict = consolidate(state_dict)
    if isinstance(state_dict, dict) and "shard" in state_dict:
        _refuse("opt.load_state_dict(): this is rank %d's part only (opt.state_dict(sharded=True)): pass every rank's, as a list"
                % state_dict["shard"]["rank"])
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        _refuse("opt.load_state_dict(): expected torch.optim's format {'state': ..., 'param_groups': ...}, got %s"
                % (sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__))
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        _refuse("opt.load_state_dict(): the dict has %d param group(s), this optimizer %d"
                % (len(saved_groups), len(opt.param_groups)))
    for i, (mine, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(saved["params"]) != len(mine["params"]):
            _refuse("opt.load_state_dict(): param group %d holds %d parameter(s) in the dict, %d here"
                    % (i, len(saved["params"]), len(mine["params"])))
    names = _param_names(opt, ddp)
    index = {}  # the dict's numbering -> this run's parameter, as torch pairs them: group by group, in order
    for mine, saved in zip(opt.param_groups, saved_groups):
        first = len(index)
        for k, old in enumerate(saved["params"]):
            index[old] = names[first + k]
    params = dict(ddp.module.named_parameters())
    kind = opt._shardflow_kind
    own = {}  # steps each parameter took
    tensors = {}
    for old, entry in state_dict["state"].items():
        if old not in index:
            _refuse("opt.load_state_dict(): state for parameter %r, which no param group of the dict lists" % (old,))
        name = index[old]
        for key in entry:
            if key not in MOMENTS[kind] and not (key == "step" and kind != "sgd"):
                _refuse("opt.load_state_dict(): parameter %d ('%s') has state %r, which shardflow's %s does not keep "
                        "(saved with another optimizer, or amsgrad?)" % (old, name, key, kind))
        shape = tuple(params[name].shape)
        for key in MOMENTS[kind]:
            t = entry.get(key)
            if t is None:
                continue
            if tuple(t.shape) != shape:
                _refuse("opt.load_state_dict(): %s of parameter %d ('%s') has shape %s, the parameter %s"
                        % (key, old, name, tuple(t.shape), shape))
            tensors["optim.%s.%s" % (name, key)] = t.detach().to(torch.float32)
        if kind == "sgd":
            own[name] = 1 if entry.get("momentum_buffer") is not None else 0
        else:
            if "exp_avg" not in entry or "exp_avg_sq" not in entry or "step" not in entry:
                _refuse("opt.load_state_dict(): parameter %d ('%s') lacks step, exp_avg or exp_avg_sq" % (old, name))
            step = float(entry["step"])
            if step != int(step) or step < 0:
                _refuse("opt.load_state_dict(): parameter %d ('%s') has step %r" % (old, name, step))
            own[name] = int(step)
    for i, (mine, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        for key, value in saved.items():
            if key != "params":
                mine[key] = value  # _Group: reaches shardflow's group, or is refused by name
    steps = max(own.values(), default=0)
    if kind == "sgd":
        steps = max(steps, ddp.optimizer_steps)
    if kind != "sgd" or any(g.get("momentum", 0) for g in opt.param_groups):  # SGD without momentum keeps nothing
        for name in names:
            for key in MOMENTS[kind]:
                tensors.setdefault("optim.%s.%s" % (name, key), torch.zeros(params[name].shape, dtype=torch.float32))
    skipped = {name: steps - own.get(name, 0) for name in names if steps - own.get(name, 0)}
    meta = {"shardflow.steps": str(steps)}
    if skipped:
        meta["shardflow.skipped_steps"] = json.dumps(skipped)
    for name, p in params.items():
        tensors[name] = p.detach()
    ddp.wait_all_params()
    ddp._ddp.load_state_dict(tensors, meta)
    ddp._refresh_groups()


def _add_param_group(opt, group):
    _refuse("opt.add_param_group(): shardflow's groups are fixed once the model is wrapped")


def adopt(opt, ddp, kind):
    """From here `opt` drives `ddp`: its methods become bound ones (as lr_scheduler expects, which
    wraps opt.step to count steps) that call the wrapper."""
    opt._shardflow_ddp = weakref.ref(ddp)
    opt._shardflow_kind = kind
    for name, fn in (("step", _step), ("zero_grad", _zero_grad), ("state_dict", _state_dict), ("load_state_dict", _load_state_dict),
                     ("add_param_group", _add_param_group)):
        setattr(opt, name, types.MethodType(fn, opt))
    opt.param_groups = [_Group(g, ddp, i, TAKEN[kind]) for i, g in enumerate(opt.param_groups)]
