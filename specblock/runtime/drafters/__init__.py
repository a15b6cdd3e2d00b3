"""Drafter registry: one place that maps ``--method`` names to drafters."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

from specblock.cpu import holds_here
from specblock.errors import SpecBlockError
from specblock.runtime.drafters.base import ARDrafter, DraftRequest, Drafter
from specblock.runtime.drafters.lookup import LookupDrafter
from specblock.runtime.drafters.random_tree import RandomDrafter
from specblock.runtime.drafters.user_policies import TAKES_POLICY, user_policies

__all__ = ["Drafter", "DraftRequest", "ARDrafter", "LookupDrafter", "RandomDrafter", "register", "build", "METHODS"]

# name -> factory(target, options) -> Drafter. Trained drafters register themselves here too.
METHODS: dict[str, Callable] = {
    "ar": lambda target, opt: ARDrafter(),
    "lookup": lambda target, opt: LookupDrafter(
        max_ngram=opt.get("ngram", 3), min_ngram=opt.get("min_ngram", 1), depth=opt.get("lookup_depth", 8),
        branches=opt.get("branches", 1),
    ),
    "random": lambda target, opt: RandomDrafter(target.vocab_size, seed=opt.get("seed", 0)),
    "specblock": lambda target, opt: _specblock(target, opt),
    "eagle3": lambda target, opt: _eagle3(target, opt),
    "medusa": lambda target, opt: _medusa(target, opt),
    "sps": lambda target, opt: _sps(target, opt),
    "parallelspec": lambda target, opt: _parallelspec(target, opt),
    "falcon": lambda target, opt: _falcon(target, opt),
}


def _path(opt: dict, method: str, target) -> Path:
    """``--drafter`` if given, else the drafter shipped for this target (``specblock.models``)."""
    if opt.get("drafter"):
        return Path(opt["drafter"])
    from specblock.models import drafters_dir

    return drafters_dir(Path(target.model.name_or_path or ".")) / method


def _specblock(target, opt: dict) -> Drafter:
    from specblock.policies.branching import RankBucketBranching
    from specblock.runtime.drafters.specblock import SpecBlockDrafter

    path = _path(opt, "specblock", target)
    return SpecBlockDrafter.load(
        path, target, M=opt.get("M", 2), max_seeds=opt.get("max_seeds", 2),
        **{"policy": RankBucketBranching(tuple(opt.get("widths", (2, 4, 10, 0)))), **user_policies("specblock", opt)},
    )


def _eagle3(target, opt: dict) -> Drafter:
    from specblock.runtime.drafters.eagle3 import Eagle3Drafter

    path = _path(opt, "eagle3", target)
    return Eagle3Drafter.load(path, target, depth=opt.get("depth"), top_k=opt.get("top_k"), **user_policies("eagle3", opt))


def _medusa(target, opt: dict) -> Drafter:
    from specblock.runtime.drafters.medusa import MedusaDrafter

    return MedusaDrafter.load(_path(opt, "medusa", target), target)


def _sps(target, opt: dict) -> Drafter:
    from specblock.runtime.drafters.sps import SpsDrafter

    path = _path(opt, "sps", target)
    return SpsDrafter.load(path, target, gamma=opt.get("gamma") or 4, top_k=opt.get("top_k") or 1,
                           **user_policies("sps", opt))


def _parallelspec(target, opt: dict) -> Drafter:
    from specblock.runtime.drafters.parallelspec import ParallelSpecDrafter

    path = _path(opt, "parallelspec", target)
    return ParallelSpecDrafter.load(path, target, top_k=opt.get("top_k"), **user_policies("parallelspec", opt))


def _falcon(target, opt: dict) -> Drafter:
    from specblock.runtime.drafters.falcon import FalconDrafter

    path = _path(opt, "falcon", target)
    return FalconDrafter.load(path, target, forwards=opt.get("forwards"), top_k=opt.get("top_k"),
                              max_seeds=opt.get("falcon_seeds"), **user_policies("falcon", opt))


def register(name: str, factory: Callable) -> None:
    METHODS[name] = factory


#: Beside a packed target (packed-fp16 or q4), drafters' linears run on our int8 kernel where the
#: CPU runs it (``int8_drafters``) and ``wants_int8`` holds. False keeps them packed fp16: the
#: baseline of ``experiments/drafter_cost.py --packed-drafters``.
INT8_DRAFTERS = True
#: Their weights' rounding there: Q8_0 (8) or Q4_1 (4; ``experiments/drafter_cost.py --q4-drafters``).
DRAFTER_BITS = 8
#: Their RMSNorms through ``exact_parts``' C++ op there (``norm_op``); False keeps the formula: the
#: baseline of ``experiments/drafter_cost.py --formula-norms``.
NORM_OP = True


def build(name: str, target, options: dict | None = None, int8: bool | None = None) -> Drafter:
    """The drafter ``name`` for ``target``. Beside a packed-fp16 or q4 target its linears run on the
    int8 kernel where the CPU has it and ``wants_int8`` holds, packed fp16 otherwise (``pack_for``;
    ``int8`` True or False decides instead); an adapting drafter trains unpacked copies and
    repacks the served net when an update lands (``runtime/adapt.py``)."""
    if name not in METHODS:
        raise SpecBlockError(f"unknown method {name!r}; choose one of {', '.join(sorted(METHODS))}")
    options = {k: v for k, v in (options or {}).items() if v is not None}  # None: not set, the default holds
    options.pop("warm_sizes", None)  # the engine's (``warm_sizes``), where a caller passed serving.json's on
    options.pop("drafter_compiled", None)  # the caller's (``drafter_compiled``), likewise
    if name not in TAKES_POLICY:
        user_policies(name, options)  # a policy named for a method without one: refused
    import torch

    # beside a bf16 CPU target, fp32 where the drafter goes on the int8 kernel (it takes fp32 activations)
    fp32 = beside_bf16(target) and _int8_wanted(target, int8)
    with _drafter_dtype(target, torch.float32) if fp32 else nullcontext():
        drafter = METHODS[name](target, options)
    pack_for(drafter, target, int8)
    return drafter


def _int8_wanted(target, int8: bool | None) -> bool:
    """Whether a drafter beside ``target`` goes on the int8 kernel: wanted (``int8``; None:
    :func:`wants_int8`) and able to run here (:func:`int8_drafters`, checked last: it builds the library)."""
    return bool(wants_int8(target) if int8 is None else int8) and int8_drafters(target)


def beside_bf16(target) -> bool:
    """A bf16 target on the CPU (HF's model, not one of our packed formats)."""
    import torch

    return (getattr(getattr(target, "device", None), "type", None) == "cpu" and not getattr(target, "packed", False)
            and getattr(target, "dtype", None) == torch.bfloat16)


@contextmanager
def _drafter_dtype(target, dtype):
    """Trained drafters load in ``dtype`` (``target.drafter_dtype``) for one ``build``: a bench's
    methods share one target, so the target's own setting comes back afterwards."""
    saved, target.drafter_dtype = target.drafter_dtype, dtype
    try:
        yield
    finally:
        target.drafter_dtype = saved


def pack_for(drafter: Drafter, target, int8: bool | None = None) -> int:
    """The drafter's linears as ``build`` serves them. Beside a packed target: on the int8 kernel
    where it runs (:func:`int8_drafters`) and is wanted (``int8``; None: :func:`wants_int8`), packed
    fp16 otherwise. Beside a bf16 CPU target, an fp32 drafter (``build`` loads it so where the int8
    kernel runs and is wanted) goes on the int8 kernel: at bf16 on a Zen 5 SpecBlock's propose fell
    from 3.8 to 2.6 ms and EAGLE-3's from 4.5 to 2.3 (``drafter_cost_zen5_bf16_int8_s77.md``). An fp32
    drafter on plain linears is no alternative: in a scratch run it was twice as slow as bf16.
    Beside any other target nothing changes. Returns how many linears moved."""
    if beside_bf16(target):
        import torch

        net = getattr(drafter, "net", None)
        fp32 = net is not None and all(p.dtype == torch.float32 for p in net.parameters())
        return pack_drafter(drafter, int8=True) if fp32 and _int8_wanted(target, int8) else 0
    if not getattr(target, "packed", False):
        return 0
    return pack_drafter(drafter, int8=_int8_wanted(target, int8))


def wants_int8(target) -> bool:
    """The default: int8 drafter linears beside an eager packed target and beside a target on our q4
    kernels (q4, packed-q4, packed-q4-amx), not beside a compiled packed-fp16 one.

    Why: a drafter's forward is a dozen linears over a few rows, where fbgemm's fp16 call costs
    1.7-4x the int8 kernel's (``experiments/drafter_linears.py``), and a drafter's precision moves
    only its drafts: the output is the target's, whatever it proposes. Eager, EAGLE-3 and SpecBlock,
    alone and with prompt lookup's branch, gained 1.2-2.9% of Spd (``bench_smollm2_int8_drafters.md``).
    Compiled, SpecBlock with the branch gained 2.5% of tokens/s
    (``bench_smollm2_compiled_int8_drafters.md``), but the kernel's library is one more C++ build
    before a first start's first compile: the default server's first start took 111.1 and 120.9 s
    with it against 106.1 and 114.1 s without (``first_start_ab_int8.md``), and issue 16 asks for
    under 2 minutes. Beside a target on our q4 kernels (the same library) it is built anyway."""
    if not INT8_DRAFTERS:
        return False
    if not getattr(target, "compiled", False):
        return True
    from specblock.runtime.q4 import keyed_q4

    model = getattr(target, "model", None)
    return model is not None and keyed_q4(model)


def start_int8_build(dtype: str, device: str, compiled: bool) -> None:
    """The int8 kernel's library starts building in the background now, beside the target's load,
    where the process will load it: a drafter on it by default beside an eager packed-fp16 or bf16 target
    (``wants_int8``), and any q4, packed-q4 or packed-q4-amx target (its own kernels are that library). A CPU with AVX512-VNNI."""
    from specblock.runtime import q4_kernel
    from specblock.runtime.target import PACKED_FP16, PACKED_Q4, PACKED_Q4_AMX, Q4, resolve_device, resolve_dtype

    dev = resolve_device(device)
    if not (INT8_DRAFTERS and dev.type == "cpu" and q4_kernel.vnni_supports()):
        return
    dtype = resolve_dtype(dtype, dev)
    if dtype in (Q4, PACKED_Q4, PACKED_Q4_AMX) or (dtype in (PACKED_FP16, "bfloat16") and not compiled):
        q4_kernel.start_building()


def int8_drafters(target) -> bool:
    """Whether a drafter beside ``target`` can run its linears on our int8 kernel: a CPU target,
    AVX512-VNNI, and the kernel's library built (it is built here on first use, once per home)."""
    import warnings

    from specblock.runtime import q4_kernel

    device = getattr(target, "device", None)
    if getattr(device, "type", "cpu") != "cpu" or not q4_kernel.vnni_supports():
        return False
    with warnings.catch_warnings():  # its warning speaks of a q4 target: here the fallback is packed fp16
        warnings.simplefilter("ignore")
        return q4_kernel.load()


def pack_drafter(drafter: Drafter, int8: bool = False) -> int:
    """Pack the linears of a drafter's network (``net``, or an SpS draft ``model``); returns how many.
    ``int8``: those that fit the int8 kernel run on their Q8_0 rounding instead (``q4.use_int8_linears``:
    several times faster than fbgemm's fp16 call at a drafter's few rows), the rest are packed."""
    import torch

    from specblock.runtime.packed import pack_linears

    nets = [m for m in (getattr(drafter, "net", None), getattr(drafter, "model", None)) if isinstance(m, torch.nn.Module)]
    if not nets or not any(type(m) is torch.nn.Linear for m in nets[0].modules()):
        return 0
    done = 0
    if int8:
        from specblock.runtime.q4 import use_int8_linears

        done = use_int8_linears(nets[0], DRAFTER_BITS)
    if any(type(m) is torch.nn.Linear for m in nets[0].modules()):
        done += pack_linears(nets[0])
    norm_op(nets[0])
    return done


def norm_op(net) -> int:
    """The net's RMSNorms served through ``exact_parts``' C++ op where a packed-fp16 target takes it
    (``exact_parts.wanted``: AVX512F, unless ``SPECBLOCK_EXACT_PARTS=off``; the target's load has built
    it by now; beside q4 the same switch decides); returns how many."""
    import torch

    from specblock.runtime import exact_parts
    from specblock.runtime.drafters.layers import RMSNorm

    if not (NORM_OP and exact_parts.wanted() and exact_parts.load()):
        return 0
    norms = [m for m in net.modules() if isinstance(m, RMSNorm) and m.weight.dtype == torch.float32]
    for m in norms:
        m.op = True
    return len(norms)


#: The engine's node budget when neither the user nor the drafter's serving.json sets one.
DEFAULT_BUDGET = 24
#: What a drafter's ``serving.json`` may set: its measured best node budget and tree settings.
SERVING_KEYS = ("budget", "M", "max_seeds", "widths", "depth", "top_k", "policy", "policy_kwargs", "warm_sizes",
                "drafter_compiled")
#: Where a serving.json may name its tree policy from: the project's own policies. A drafter folder
#: is data, and naming a class imports (runs) its module; a user's own class is a flag away.
SERVING_POLICY_PREFIX = "specblock.policies."
_SERVING_POLICY = re.compile(re.escape(SERVING_POLICY_PREFIX) + r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # a module, not a file
TRAINED = ("specblock", "eagle3", "medusa", "sps", "parallelspec", "falcon")


def warm_sizes(opts: dict) -> tuple[int, ...] | None:
    """Pop a serving.json's ``warm_sizes`` from the drafter's options: the tree sizes a compiled
    target compiles before it serves (``Engine.warm_sizes``), where traces showed the others rare
    enough to pad up (each graph is half a minute of a first start). Not a drafter's option."""
    sizes = opts.pop("warm_sizes", None)
    return tuple(sizes) if sizes else None


def drafter_compiled(opts: dict, default: bool, eager: bool = False) -> bool:
    """Pop a serving.json's ``drafter_compiled``: whether the drafter's step runs compiled beside this
    target, ``default`` (the target's own mode) where the file says nothing, never with ``eager``
    (``--eager-drafter``). Beside an eager target it pays where the CPU charges per dispatched op:
    SpecBlock's two-layer step beside the eager q4 target on a Zen 5
    (``bench_smollm2_zen5_drafter_compiled_tune_s72.md``). The caller compiles (``compiled/`` sits
    above the drafters); not a drafter's option. One rule for the CLI, the server and ``calibrate``."""
    value = opts.pop("drafter_compiled", None)
    return (default if value is None else value) and not eager


def serving_settings(name: str, target, options: dict) -> dict:
    """``options`` over the drafter's measured best serving settings over the built-in defaults.

    A trained drafter ships ``serving.json`` beside its config (the budget sweep's winner, e.g.
    the lab SpecBlock drafter's 8 nodes), so a user who sets nothing gets the measured best and
    not one budget for every method. Options left at None do not override it.

    What a tree costs depends on the target's dtype and on whether it runs compiled (a row of a
    compiled q4 tree costs about a sixth of a token's forward, of an eager packed-fp16 one far
    less), so ``serving.json`` may hold ``"overrides"``: a list of objects, each with ``dtype``,
    ``compiled`` and/or ``cpu`` to match the target (``target.dtype_name``, ``target.compiled``,
    ``specblock.cpu.cpu_kind()``) and the settings measured there, applied in order over the file's own.
    """
    explicit = {k: v for k, v in options.items() if v is not None}
    if not explicit.get("policy"):
        explicit.pop("policy_kwargs", None)  # the CLI's empty default is no choice
    if name not in TRAINED:
        return explicit
    saved = read_serving(_path(explicit, name, target) / "serving.json", target)
    if not explicit.get("drafter"):  # the shipped drafter: a budget tuned on this machine over its own
        saved = over_tuned(saved, name, target)
    return over_serving(saved, explicit)


def over_tuned(saved: dict, name: str, target) -> dict:
    """``saved`` with the settings ``tune --budgets`` measured for drafter ``name`` on this machine
    (``$SPECBLOCK_HOME/tuned/MODEL/NAME/serving.json``, its overrides for this CPU, dtype and mode).
    A budget of its own drops the shipped ``warm_sizes``, which were measured on the shipped trees."""
    from specblock.models.registry import tuned_record

    model = getattr(getattr(target, "model", None), "name_or_path", None)
    f = tuned_record(Path(model)) if model else None
    tuned = read_serving(f.parent / name / "serving.json", target) if f is not None else {}
    if tuned.get("budget", saved.get("budget")) != saved.get("budget"):
        saved = {k: v for k, v in saved.items() if k != "warm_sizes"}
    return {**saved, **tuned}


def over_serving(saved: dict, explicit: dict) -> dict:
    """``explicit`` options over a serving.json's ``saved`` settings: a tree rule of the user's own
    (``policy`` or ``widths``) replaces the file's whole (the simulator's settings follow it too).
    The file's ``warm_sizes`` were measured on its own trees: any tree setting of the user's drops
    them (the drafter's every size is warmed then)."""
    if explicit.get("policy") or explicit.get("widths"):
        saved = {k: v for k, v in saved.items() if k not in ("policy", "policy_kwargs")}
    if any(k in explicit for k in SERVING_KEYS):
        saved = {k: v for k, v in saved.items() if k != "warm_sizes"}
    return {**saved, **explicit}


def read_serving(f: Path, target) -> dict:
    """The settings of serving.json ``f`` (none where it is absent) for ``target``: its own, then
    each of its ``overrides`` whose ``dtype``, ``compiled`` and ``cpu`` match the target's and this CPU."""
    try:
        saved = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        raise SpecBlockError(f"{f} is not valid JSON; fix or delete it") from None
    if not isinstance(saved, dict):
        raise SpecBlockError(f"{f} must hold a JSON object of serving settings")
    settings = {k: v for k, v in saved.items() if k in SERVING_KEYS}
    overrides = saved.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
        raise SpecBlockError(f"{f}: \"overrides\" must be a list of objects, e.g. "
                             '[{"dtype": "q4", "compiled": true, "budget": 1}]')
    here = {"dtype": getattr(target, "dtype_name", None), "compiled": bool(getattr(target, "compiled", False))}
    for o in overrides:
        if holds_here(o, f, **here):
            settings.update({k: v for k, v in o.items() if k in SERVING_KEYS})
    warm = settings.get("warm_sizes")
    if warm is not None and not (isinstance(warm, list) and warm and all(type(n) is int and n >= 1 for n in warm)):
        raise SpecBlockError(f"{f}: \"warm_sizes\" must be a list of tree sizes (positive integers), e.g. [1, 4, 6, 7]")
    if type(settings.get("drafter_compiled", False)) is not bool:
        raise SpecBlockError(f"{f}: \"drafter_compiled\" must be true or false")
    pol = settings.get("policy")
    if pol is not None and not (isinstance(pol, str) and _SERVING_POLICY.fullmatch(pol)):
        raise SpecBlockError(f"{f}: \"policy\" {pol!r} is not one of {SERVING_POLICY_PREFIX}*; "
                             "name your own class with --policy instead")
    return settings

