"""What the user's forward does during ``torch.export`` that the exported graph cannot carry: a
custom ``torch.autograd.Function``'s backward, ``Tensor.register_hook``, reentrant checkpointing,
inference mode, saved-tensor hooks, Python-level random draws, what it reads of the
process's state (grad mode, global flags, memory layout, device) and ``is_compiling()`` questions,
recorded by :class:`_Watch` around one export (Note [What export does not capture]).
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import sys
import threading
import types
from typing import Any

import torch
from torch import nn

from ..errors import WideCompileError
from ..registry import running_registered
from .hook_writes import _SITE, _hook_code, _refuse_fake_leaks
from .source import _OUR_DIR, is_user_file, location, user_frame_and_module

__all__: list[str] = []

log = logging.getLogger("wide_compiler.fx.capture")  # the capture's records under one name


class _Watch:
    """Note [What export does not capture]: within the block (one export), records what the user's
    forward does that the exported graph cannot carry:

    * a custom ``torch.autograd.Function`` (one defined in the user's code or a library's, not
      torch's or wide_compiler's own): export traces its forward, its backward is lost (the
      wide model's gradient would be autograd's of the forward: a straight-through estimator's
      gradient becomes 0, a gradient-reversal layer's the identity). Every one counts, also one
      whose backward looks like autograd's gradient of its forward (a memory-saving GeLU):
      Note [Custom Functions are not sampled]. A registered module's wide form may call one (its
      backward then runs: BLOOM's GeLU, nn/library_forms.py);
    * ``Tensor.register_hook`` on an activation: the hook never runs in the wide model's backward;
    * reentrant activation checkpointing, a ``torch.inference_mode()`` block, ``saved_tensors_hooks``
      with hooks not torch's own, and draws from Python's or numpy's global generator (Note
      [Autograd contexts export drops]): refused in a train graph, warned in an eval graph;
    * what the forward reads of the state of the process, whose branch is baked in (Note [State a
      forward reads] in fx/guards.py): the grad mode (``torch.is_grad_enabled()``,
      ``torch.is_inference_mode_enabled()``), the global flags of ``guards.FLAG_READERS``
      (determinism, autocast, the default dtype, matmul precision), an input's memory layout
      (``Tensor.is_contiguous``, ``Tensor.stride``), a tensor's device (``.device``,
      ``.is_cuda``, ``.is_cpu``) and a tensor's dtype, which autocast changes (Note [A dtype the
      forward reads]): each becomes a guard of the graph, checked at every call;
    * ``torch.compiler.is_compiling()`` / ``is_exporting()`` (and ``torch._dynamo.is_compiling``,
      ``torch._utils.is_compiling``, which call it), called from the user's own code (not a
      library's under site-packages, not torch's): export runs the forward with them True, each
      member alone with them False. The user's code gets False here, so the graph takes the branch
      each member takes alone (export fails, and says so, where that branch cannot be captured);
      a library's code keeps export's answer (its export support chose that branch for export).
      The function objects themselves answer (their code is swapped for the block), so a name
      imported with ``from torch.compiler import is_compiling`` answers the same.

    :meth:`check` refuses a train graph with the first two (and a module's backward hooks, which
    export drops too), naming the class and line; an eval graph only warns (its forward values are
    the members'; a backward through it would not be, and is refused). Only calls from the user's code count (not
    torch's or wide_compiler's own).

    The patches are process-wide (installed by the first block to open, removed by the last to
    close, under a lock) and record only for the thread whose export opened a block: another
    thread's calls get the real functions' answers."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model  # whose numpy generators are looked at (Note [Autograd contexts export drops])

    def __enter__(self) -> _Watch:
        # torch.export imports sympy, whose import draws (the index of sympy's Dummy symbols): done
        # before the block, so that a first capture in the process does not take it for the forward's
        import sympy  # noqa: F401

        self.functions: list = []
        self.hooks: list[str] = []
        self.grad_mode: bool | None = None
        self.flags: dict[tuple[str, tuple], Any] = {}
        self.layout: list[str] = []  # where the user's code read a tensor's memory layout
        self.device: list[str] = []  # where it read a tensor's device
        self.compiling: list[str] = []  # where it asked is_compiling()/is_exporting() (answered False)
        self.reentrant: list[str] = []  # where it ran torch.utils.checkpoint's reentrant checkpoint
        self.inference: list[str] = []  # where it entered torch.inference_mode()
        self.saved_hooks: list[str] = []  # where it entered saved_tensors_hooks with hooks of its own
        self.draws: list[str] = []  # where it drew from Python's or numpy's global generator (seen by name)
        self.drawn: list[str] = []  # which global generators moved during the block
        self._rng = _global_rng_states()
        self._generators = _numpy_generators(self.model) if self.model is not None else []
        with _WATCH_LOCK:
            if not _WATCHES:
                _install_watch_patches()
            _WATCHES.setdefault(threading.get_ident(), []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        after = _global_rng_states()
        self.drawn = list(dict.fromkeys([*self.drawn, *(name for name, state in self._rng.items()
                                                        if after.get(name) != state),
                                         *(label for label, gen, state in self._generators
                                           if _numpy_state(gen) != state)]))
        with _WATCH_LOCK:
            mine = _WATCHES.get(threading.get_ident(), [])
            if self in mine:
                mine.remove(self)
            if not mine:
                _WATCHES.pop(threading.get_ident(), None)
            if not _WATCHES:
                _remove_watch_patches()

    def reads(self) -> dict[str, Any]:
        """What the forward read of the process's state, as plain values (Note [State a forward
        reads] in fx/guards.py): ``grad_mode`` (bool or None), ``flags`` (``((reader, args),
        value)`` pairs), ``layout`` and ``device`` (whether read), ``compiling`` (where)."""
        return {"grad_mode": self.grad_mode, "flags": tuple(self.flags.items()), "layout": bool(self.layout),
                "device": bool(self.device), "compiling": tuple(dict.fromkeys(self.compiling))}

    def check(self, model: nn.Module) -> str | None:
        """Refuse a train graph whose backward would not be the members' (a custom Function, a
        gradient hook, a module's backward hook, reentrant checkpointing, an inference-mode block,
        saved-tensor hooks) or whose Python draws random numbers (what, where, why, what to do),
        before anything is built from it; warn for an eval graph, and return what its backward
        would not follow (None when nothing): the wide model refuses a backward through it (Note
        [An eval graph whose backward is not the members'] in fx/state.py). Note [Custom Functions
        are not sampled], Note [Autograd contexts export drops]."""
        _refuse_fake_leaks(model)  # Note [Hooks that write outside themselves]: the net behind the code read
        contexts = self._check_contexts(model)
        hooks = [f"{name or type(model).__name__} ({type(m).__name__}) has a backward hook"
                 for name, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
        from torch.nn.modules import module as torch_module
        hooks += [f"torch's global module backward hook (torch.nn.modules.module.{d}: "
                  f"register_module_{'full_backward_pre_hook' if 'pre' in d else 'full_backward_hook'}), which every "
                  f"module's backward runs" for d in ("_global_backward_hooks", "_global_backward_pre_hooks")
                  if getattr(torch_module, d, None)]
        paths = {id(m): name for name, m in model.named_modules()}
        functions = [f"the custom autograd function {cls.__qualname__} ({where}"
                     f"{'' if id(owner) not in paths else f', module {paths[id(owner)]!r}' if paths[id(owner)] else ''}"
                     f"; class in {cls.__module__})" for cls, where, owner in self.functions]
        found = [*functions, *(f"Tensor.register_hook {h}" for h in self.hooks), *hooks]
        if not found:
            return "; ".join(contexts) or None
        what = "; ".join(dict.fromkeys(found))
        if model.training:
            why = ("torch.export captures the forward only: the train graph's backward would not run it (a "
                   "custom Function's backward, a hook), so its gradients would not be the members'")
            if functions:
                names = ", ".join(dict.fromkeys(f"{cls.__qualname__}.backward" for cls, _, _ in self.functions))
                why += (f": it would be autograd's gradient of the traced forward, not {names}, which may "
                        "depend on the values, the sizes or Python state, so no sample can prove the two "
                        "equal")
            raise WideCompileError(
                f"wide_compiler: {what}, in member 0's forward (captured for every member: each runs the "
                f"same code). {why} (Note [What export does not capture] in fx/export_watch.py).\n"
                "What to do: compile the members in eval mode (model.eval(): the forward is exact; a backward "
                "through it is autograd's, with a warning); or write that function with differentiable torch "
                "ops (autograd's gradient is then the members'); or give its module a wide form with "
                "@wide_compiler.register (its own Python runs per member); or train the members without it.")
        log.warning("wide_compiler: %s: the eval graph computes the members' outputs, but a backward through "
                    "it would not run that code, so the wide model refuses one (Note [What export does not "
                    "capture])", what)
        return "; ".join([what, *contexts])


    def _check_contexts(self, model: nn.Module) -> list[str]:
        """Note [Autograd contexts export drops]: refuse (train graph) or warn (eval graph) for the
        contexts of the forward the capture recorded that the graph does not carry; returns those
        (of an eval graph) a backward would not follow."""
        name = type(model).__name__
        found = []  # (what, why, what to do); why says what the train graph would get wrong
        if self.reentrant:
            found.append((
                "torch.utils.checkpoint's reentrant checkpointing (checkpoint(..., use_reentrant=True) or "
                f"checkpoint_sequential(..., use_reentrant=True)) {'; '.join(dict.fromkeys(self.reentrant))}",
                "reentrant checkpointing runs the block under torch.no_grad() inside an autograd Function of "
                "torch's own and recomputes it in that Function's backward, which torch.export does not capture: "
                "the train graph would carry no gradient through the block (its parameters and the inputs before "
                "it would get none)",
                "pass use_reentrant=False (torch's recommended mode: it is captured exactly, values and "
                "gradients the members')"))
        if self.inference:
            found.append((
                f"a torch.inference_mode() block {'; '.join(dict.fromkeys(self.inference))}",
                "torch.export does not capture inference mode: the train graph would record autograd through the "
                "block, where each member gives the tensors made there no autograd history (the block's "
                "parameters would get gradients they do not get alone)",
                "use torch.no_grad() for that block (captured exactly: the same values, and no gradient through "
                "it, as for each member)"))
        if self.saved_hooks:
            found.append((
                f"torch.autograd.graph.saved_tensors_hooks with hooks of its own {'; '.join(dict.fromkeys(self.saved_hooks))}",
                "torch.export captures the forward's ops, not the hooks that pack and unpack the tensors autograd "
                "saves: the wide model's backward would use the saved values as they are, where each member's "
                "uses what its unpack hook returns",
                "compile the members without those hooks (torch's own save_on_cpu() keeps the values and "
                "compiles), or in eval mode"))
        if self.drawn:
            where = "; ".join(dict.fromkeys(self.draws)) or (
                "through its methods" if all(d.startswith("the numpy ") for d in self.drawn) else
                "somewhere in the forward (not through a module attribute such as random.random: a function "
                "imported by name)")
            found.append((
                f"a draw from {' and '.join(self.drawn)} ({where})",
                "the capture runs the forward once: the number drawn then, and every branch it chose (LayerDrop's "
                "`random.random() < p`), would be fixed in the graph, and the wide model would take them on every "
                "call, where each member draws anew at each call",
                "draw with torch's generator and keep it a tensor, so that each member draws its own at each call "
                "(the wide model draws per member): `keep = (torch.rand((), device=x.device) >= p).to(x.dtype); "
                "return x + keep * block(x)`, or torchvision.ops.stochastic_depth; a Python branch on a torch "
                "draw cannot be captured"))
        if not found:
            return []
        if model.training:
            what, why, todo = found[0]
            raise WideCompileError(
                f"wide_compiler: {what}, in member 0's forward ({name}; captured for every member: each runs the "
                f"same code): {why} (Note [Autograd contexts export drops] in "
                f"fx/export_watch.py).\nWhat to do: {todo}.")
        for what, why, _ in found:
            log.warning("wide_compiler: %s, in %s's forward: the eval graph is captured, but %s (Note [Autograd "
                        "contexts export drops])", what, name,
                        "the values drawn at capture are fixed in it" if what.startswith("a draw") else
                        "a backward through it would not follow the members', so the wide model refuses one")
        return [what for what, _, _ in found if not what.startswith("a draw")]


# Note [Autograd contexts export drops]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Four things a forward may do run in the member alone and leave no trace in what torch.export
# (non-strict) captures, so a train graph would compute other gradients or other values than the
# members, silently (probe 6 of issue 44, F11, F12, F13, F5):
#
# * reentrant activation checkpointing (``checkpoint(fn, x, use_reentrant=True)``,
#   ``checkpoint_sequential(..., use_reentrant=True)``): torch's ``CheckpointFunction`` runs the
#   block under no_grad and recomputes it in its backward; export keeps the no_grad forward only,
#   so no gradient reaches the block's parameters or what came before it. Its exact semantics
#   also depend on whether an input requires grad at the call (none does: the member's block
#   gets no gradient either), which a graph could not follow. ``use_reentrant=False`` is captured
#   exactly (its saved-tensor hooks are torch's own, below).
# * ``torch.inference_mode()`` (entered with mode True; the decorator form too): export drops it,
#   and the train graph differentiates through the block. ``torch.no_grad()`` is captured (a
#   grad-mode region of the graph) and, for every member that runs without error, gives the same
#   values and gradients (a member can use an inference tensor in autograd only where autograd
#   saves nothing of it, so the block's outputs are constants to it, as under no_grad). It is
#   refused with that advice rather than rewritten: where a member raises (an inference tensor
#   saved for backward, updated in place) the rewrite would compute instead.
# * ``torch.autograd.graph.saved_tensors_hooks`` whose pack or unpack hook is not torch's own
#   (``save_on_cpu`` and non-reentrant checkpointing use torch's, which give back the saved value
#   and are not recorded): the graph's backward uses the saved tensors as they are, not what
#   unpack returns (lossy activation compression).
# * a draw from Python's ``random`` or numpy's global generator: seen as a change of the
#   generator's state across the capture (any caller, a name imported with ``from random import
#   random`` too), and located where the call went through the module attribute (``random.random``,
#   ``np.random.rand``); and a draw from a ``random.Random`` of the user's own (``self.rng =
#   random.Random(0)``), seen where the user's code calls its method. The capture runs the forward
#   once; the number and the branches it chose are baked into the graph. The global state is
#   process-wide: a draw by another thread during the capture counts too (a refusal, never a wrong
#   result). A numpy ``Generator``/``RandomState`` of the user's own (``RNG =
#   np.random.default_rng(0)``), whose methods cannot be patched, is seen as a change of its state
#   across the capture, for those a module of the tree holds and those a ``forward`` names as a
#   global or closure variable (not one that only a helper function reads).
#
# A train graph is refused (what, where, why, what to do); an eval graph is kept with a warning:
# its forward values are the members' for the first three (a backward through it would not be,
# and raises: Note [An eval graph whose backward is not the members'] in fx/state.py),
# and for a draw the warning says the value is fixed (HF's MusicGen draws `random.uniform(0, 1)`
# in eval too and only uses it when training).


# -- the patches of _Watch (process-wide while any export runs under one) ----------------------------

_WATCH_LOCK = threading.Lock()
_WATCHES: dict[int, list[_Watch]] = {}  # thread id -> the watches open in that thread (innermost last)
_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, attribute, what was there: _ABSENT if nothing)
_ABSENT = object()


def _calling_module() -> nn.Module | None:
    """The innermost module whose method is running (``self`` of a frame up the stack), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            return owner
        frame = frame.f_back
    return None


def _watching() -> _Watch | None:
    if running_registered():  # a registered module's forward, run for shapes: its wide form runs its own Python
        return None
    mine = _WATCHES.get(threading.get_ident())
    return mine[-1] if mine else None


def _user_caller(depth: int = 2, *, ours: bool = True) -> bool:
    """Whether the caller of the patched function (``depth`` frames up) is the user's code;
    ``ours=False``: the first caller outside wide_compiler's own code."""
    frame = sys._getframe(depth)
    while not ours and frame.f_back is not None and frame.f_code.co_filename.startswith(_OUR_DIR):
        frame = frame.f_back
    return is_user_file(frame.f_code.co_filename)


# Note [A dtype the forward reads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Export fixes every dtype the forward reads from a tensor to the one it had at capture:
# ``torch.arange(n, dtype=h.dtype)``, ``x.to(h)``, ``h.new_tensor(...)``, ``if h.dtype ==
# torch.bfloat16``, ``h * h.element_size()`` leave the sample's dtype in the graph. Under autocast
# the member reads another one there (a Linear's output is bfloat16 under CPU autocast), so a graph
# captured outside autocast and run inside it returned float32 where the member returned bfloat16,
# or took the other branch (0.004 to 2.4 off in member 0, silently). So a read of a tensor's dtype
# from the user's code during capture (the ``dtype``, ``itemsize`` and ``nbytes`` of a fake tensor,
# ``element_size()``, ``type()``, ``new_tensor``/``new_zeros``/``new_ones``/``new_empty``/``new_full``
# and ``to(other)``) counts as a read of the autocast state, every device's (``is_autocast_enabled``,
# ``get_autocast_dtype``: a model moves with ``.to()``): a call under another autocast state fails
# that guard and the graph is captured again under the call's state, where export reads the dtype
# the member reads, as for a forward that asks ``torch.is_autocast_enabled()`` itself. Only the
# user's reads count (torch reads dtypes everywhere); a forward that reads none keeps one graph for
# every autocast state, the wide ops casting as ATen's autocast casts the ops they replace. (The
# parameters' own dtype changing: Note [A graph runs in the dtype it was captured in], model.py.)
_DTYPE_PROPERTIES = ("dtype", "itemsize", "nbytes")
_DTYPE_METHODS = ("element_size", "type", "new_tensor", "new_zeros", "new_ones", "new_empty", "new_full")


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHED.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def _install_watch_patches() -> None:
    from .guards import FLAG_READERS
    from .state_reads import _AUTOCAST_READERS, _BOUND_ARGS

    fn_cls = torch.autograd.function.Function
    apply, register_hook = fn_cls.__dict__["apply"], torch.Tensor.register_hook

    def watched_apply(cls, *args: Any, **kwargs: Any) -> Any:
        watch = _watching()
        if watch is not None:
            try:
                user = is_user_file(inspect.getfile(cls))
            except (TypeError, OSError):  # a class without a source file
                user = False
            if user:
                watch.functions.append((cls, user_frame_and_module(), _calling_module()))
            elif cls.__module__ == "torch.utils.checkpoint" and cls.__name__ == "CheckpointFunction":
                watch.reentrant.append(user_frame_and_module())  # Note [Autograd contexts export drops]
        return apply.__func__(cls, *args, **kwargs)

    def watched_register_hook(t: torch.Tensor, hook: Any) -> Any:
        watch = _watching() if _user_caller() else None
        if watch is not None:
            watch.hooks.append(user_frame_and_module())
        return register_hook(t, hook)

    def grad_read(fn: Any) -> Any:
        def read() -> bool:
            value = fn()
            watch = _watching() if _user_caller() else None  # the caller first: most calls are torch's
            if watch is not None:
                watch.grad_mode = torch._C.is_grad_enabled()
            return value
        return read

    def flag_read(name: str, fn: Any) -> Any:
        def read(*args: Any) -> Any:
            value = fn(*args)
            watch = _watching() if _user_caller() else None  # the caller first: most calls are torch's
            if watch is not None:
                watch.flags[(name, tuple(args))] = value
            return value
        read.__name__ = read.__qualname__ = name
        return read

    def layout_read(fn: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            watch = _watching() if _user_caller() else None  # the caller first: most calls are torch's
            if watch is not None:
                watch.layout.append(user_frame_and_module())
            return fn(self, *args, **kwargs)
        return read

    def device_read(getter: Any) -> property:
        def read(self: torch.Tensor) -> Any:
            watch = _watching() if _user_caller() else None  # the caller first: most calls are torch's
            if watch is not None:
                watch.device.append(user_frame_and_module())
            return getter(self)
        return property(read)

    def autocast_read(watch: _Watch) -> None:  # Note [A dtype the forward reads]
        for name in _AUTOCAST_READERS:
            for args in _BOUND_ARGS[name]:
                watch.flags.setdefault((name, args), FLAG_READERS[name](*args))

    def dtype_property(getter: Any) -> property:
        def read(self: torch.Tensor) -> Any:
            watch = _watching() if _user_caller() else None  # the caller first: most calls are torch's
            if watch is not None:
                autocast_read(watch)
            return getter(self)
        return property(read)

    def dtype_method(fn: Any, *, of_other: bool = False) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # past our own wrappers (export_aliases' conversions wrap .to and .type after this)
            watch = _watching() if _user_caller(ours=False) else None
            if watch is not None and (not of_other or any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))):
                autocast_read(watch)
            return fn(self, *args, **kwargs)
        return read

    inference_mode = torch.autograd.grad_mode.inference_mode
    inference_enter = inference_mode.__dict__["__enter__"]

    def watched_inference_enter(self: Any) -> Any:
        watch = _watching()
        if watch is not None and self.mode:
            watch.inference.append(user_frame_and_module())
        return inference_enter(self)

    saved_hooks = torch.autograd.graph.saved_tensors_hooks
    saved_enter = saved_hooks.__dict__["__enter__"]

    def watched_saved_enter(self: Any) -> Any:
        watch = _watching()
        if watch is not None:
            own = [h for h in (self.pack_hook, self.unpack_hook)
                   if (code := _hook_code(h)) is not None and is_user_file(code.co_filename)]
            if own:  # not torch's own (save_on_cpu, non-reentrant checkpointing): Note [Autograd contexts export drops]
                names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in own)
                watch.saved_hooks.append(f"({type(self).__qualname__}: {names}) {user_frame_and_module()}")
        return saved_enter(self)

    def draw_read(label: str, fn: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            watch = _watching()
            if watch is not None:
                watch.draws.append(f"{label}() {user_frame_and_module()}")
            return fn(*args, **kwargs)
        return draw

    from torch._subclasses.fake_tensor import FakeTensor

    _patch(fn_cls, "apply", classmethod(watched_apply))
    _patch(inference_mode, "__enter__", watched_inference_enter)
    _patch(saved_hooks, "__enter__", watched_saved_enter)
    np_random = sys.modules.get("numpy.random")
    for module, label, names in ((random, "random", _PY_DRAWS), (np_random, "numpy.random", _NP_DRAWS)):
        for name in names if module is not None else ():
            fn = module.__dict__.get(name)
            if callable(fn):
                _patch(module, name, draw_read(f"{label}.{name}", fn))

    def instance_draw(name: str, fn: Any) -> Any:  # a draw from a random.Random of the user's own
        def draw(self: random.Random, *args: Any, **kwargs: Any) -> Any:
            watch = _watching() if is_user_file(sys._getframe(1).f_code.co_filename, skip_stdlib=True) else None
            if watch is not None:
                watch.draws.append(f"{type(self).__name__}.{name}() {user_frame_and_module()}")
                watch.drawn.append(f"a {type(self).__name__} instance's generator")
            return fn(self, *args, **kwargs)
        return draw

    for name in _PY_DRAWS:
        fn = getattr(random.Random, name, None)
        if callable(fn):
            _patch(random.Random, name, instance_draw(name, fn))
    _patch(torch.Tensor, "register_hook", watched_register_hook)
    _patch(torch, "is_grad_enabled", grad_read(torch.is_grad_enabled))
    _patch(torch, "is_inference_mode_enabled", grad_read(torch.is_inference_mode_enabled))
    for name, fn in FLAG_READERS.items():
        _patch(torch, name, flag_read(name, fn))
    for name in ("is_contiguous", "stride"):
        _patch(torch.Tensor, name, layout_read(getattr(torch._C.TensorBase, name)))
    for owner, name in ((FakeTensor, "device"), (torch.Tensor, "is_cuda"), (torch.Tensor, "is_cpu")):
        _patch(owner, name, device_read(getattr(owner, name).__get__))
    for name in _DTYPE_PROPERTIES:
        _patch(FakeTensor, name, dtype_property(getattr(torch._C.TensorBase, name).__get__))
    for name in _DTYPE_METHODS:
        _patch(torch.Tensor, name, dtype_method(getattr(torch._C.TensorBase, name)))
    _patch(torch.Tensor, "to", dtype_method(torch._C.TensorBase.to, of_other=True))
    for fn, shim in _COMPILING_SHIMS:
        _PATCHED.append((fn, "__code__", fn.__code__))
        fn.__code__ = shim


# the functions of Python's random module and numpy.random's global generator that draw; a call
# through the module attribute is located (Note [Autograd contexts export drops])
_PY_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss",
             "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate", "betavariate",
             "paretovariate", "weibullvariate", "triangular", "getrandbits", "randbytes", "binomialvariate")
_NP_DRAWS = ("random", "rand", "randn", "randint", "random_sample", "ranf", "sample", "uniform", "normal",
             "standard_normal", "choice", "permutation", "shuffle", "binomial", "poisson", "exponential", "beta",
             "gamma", "bytes", "random_integers")


def _global_rng_states() -> dict[str, Any]:
    """The states of the process's global Python-level generators (Python's ``random``, numpy's
    legacy global generator when numpy is imported), by name, comparable with ``==``."""
    states: dict[str, Any] = {"Python's random module": random.getstate()}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            kind, keys, *rest = np_random.get_state()
            states["numpy.random's global generator"] = (kind, keys.tobytes(), *rest)
        except Exception:  # noqa: BLE001 -- a numpy without the legacy generator: nothing to compare
            pass
    return states


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def _numpy_state(gen: Any) -> Any:
    """A numpy ``Generator``'s or ``RandomState``'s state, comparable with ``==``."""
    if hasattr(gen, "bit_generator"):
        return repr(gen.bit_generator.state)
    kind, keys, *rest = gen.get_state()
    return (kind, keys.tobytes(), *rest)


def _numpy_generators(model: nn.Module) -> list[tuple[str, Any, Any]]:
    """The numpy ``Generator``/``RandomState`` objects of the user's own that ``model``'s code can
    draw from, with their states: held by a module of the tree, or a global or closure variable
    that the ``forward`` of one of its classes names (Note [Autograd contexts export drops]):
    their methods cannot be patched, so a draw is seen as a change of state across the capture."""
    np_random = sys.modules.get("numpy.random")
    if np_random is None:
        return []
    kinds = (np_random.Generator, np_random.RandomState)
    found: dict[int, tuple[str, Any]] = {}
    for path, m in model.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, kinds):
                found.setdefault(id(v), (f"the numpy {type(v).__name__} self.{k} of {path or 'the root'}", v))
        for cls in type(m).__mro__:
            fn = inspect.unwrap(cls.__dict__.get("forward", None) or (lambda: None))
            code = getattr(fn, "__code__", None)
            if code is None or not is_user_file(code.co_filename):
                continue
            names, stack = set(), [code]
            while stack:
                c = stack.pop()
                names.update(c.co_names)
                stack.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
            cells = {n: _cell(c) for n, c in zip(code.co_freevars, fn.__closure__ or ())}
            for name in names | set(cells):
                v = cells[name] if name in cells else fn.__globals__.get(name)
                if isinstance(v, kinds):
                    found.setdefault(id(v), (f"the numpy {type(v).__name__} `{name}` ({fn.__module__})", v))
    return [(label, v, _numpy_state(v)) for label, v in found.values()]


def _remove_watch_patches() -> None:
    while _PATCHED:
        owner, name, old = _PATCHED.pop()
        if old is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


def _answer_compiling(frame: Any, which: int) -> bool:
    """The answer of ``torch.compiler.is_compiling`` (``which`` 0) or ``is_exporting`` (1) while
    a :class:`_Watch` is open: False to the user's own code in the watching thread (what a member
    alone sees), recorded; the real answer to anything else."""
    while frame is not None and frame.f_code in _compiling_wrappers():
        frame = frame.f_back
    filename = frame.f_code.co_filename if frame is not None else ""
    # the caller first: most calls are torch's (and a _Watch is open whenever this runs)
    watch = _watching() if is_user_file(filename) and not any(s in filename for s in _SITE) else None
    if watch is not None:
        watch.compiling.append(location(filename, frame.f_lineno, frame.f_code.co_name))
        return False
    return _COMPILING_ORIGINALS[which]()


def _is_compiling_shim() -> bool:  # the code torch.compiler.is_compiling runs within a _Watch
    import sys
    return sys.modules["wide_compiler.fx.export_watch"]._answer_compiling(sys._getframe(1), 0)


def _is_exporting_shim() -> bool:  # the code torch.compiler.is_exporting runs within a _Watch
    import sys
    return sys.modules["wide_compiler.fx.export_watch"]._answer_compiling(sys._getframe(1), 1)


_COMPILING_FNS = (torch.compiler.is_compiling, torch.compiler.is_exporting)
_COMPILING_ORIGINALS = tuple(types.FunctionType(f.__code__, f.__globals__, f.__name__) for f in _COMPILING_FNS)
_COMPILING_SHIMS = tuple(zip(_COMPILING_FNS, (_is_compiling_shim.__code__, _is_exporting_shim.__code__)))


@functools.cache
def _compiling_wrappers() -> frozenset:
    """torch's own functions that only pass is_compiling() on: the frame that asks is their
    caller's. Looked up at the first capture: importing torch._dynamo costs seconds, and a
    capture (torch.export) has imported it by then."""
    import torch._dynamo.external_utils as external_utils

    return frozenset(f.__code__ for f in (external_utils.is_compiling, torch._utils.is_compiling)
                     if isinstance(f, types.FunctionType))


# Note [Custom Functions are not sampled]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A train graph with a custom torch.autograd.Function is refused, every one. An earlier version
# accepted one whose backward gave autograd's gradient of its forward on one random float64
# sample of the traced sizes; the wide model then ran autograd's gradient and never the
# Function's backward. A backward is Python: it may test the values (`where(|x| > 6, 0, g)`, an
# outlier guard), the sizes (`g / g.shape[0]` past some batch) or a global, and a sample sees none
# of that -- an independent probe (issue 44, probe 4 F4) found parameter gradients 2 to 179 off.
# Equality of two programs cannot be proved by running them; the project verifies, it does not
# sample. torch's and wide_compiler's own Functions are not recorded (their ops are captured as
# ATen ops with their own derivatives); a library's is the user's here, unless a registered wide
# form of its module calls it on the wide tensor (transformers' BLOOM GeLU: nn/library_forms.py).
# The eval graph keeps its forward values exact and warns; a backward through it (input gradients
# of an eval model) would be autograd's, so it is refused at the backward (Note [An eval graph
# whose backward is not the members'] in fx/state.py).
