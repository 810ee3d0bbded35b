#!/usr/bin/env python3
"""torchrun for Debian 12: its python3-torch (1.13) on Python 3.11 fails before starting any rank
("AttributeError: 'NoneType' object has no attribute 'get'" in elastic/multiprocessing/api.py).
Std.from_str compares enum members with plain ints, which Python 3.11's enums no longer equal, so
--redirects / --tee (default "0") parse to None. This runs torch's own launcher with that one parse
fixed; every argument is torchrun's.

  /usr/bin/python3 tools/torchrun_py311.py --standalone --nproc_per_node 2 train.py ...   (torch 1.13 spells it with underscores)
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import api
from torch.distributed.run import main

_parse = api.Std.from_str


def _from_str(vm):
    if re.fullmatch(r"[0-7]", vm):
        return api.Std(int(vm))
    return {int(k): api.Std(int(v)) for k, v in (kv.split(":") for kv in vm.split(","))} if ":" in vm else _parse(vm)


api.Std.from_str = classmethod(lambda cls, vm: _from_str(vm))

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    sys.exit(main())
