"""The error a failed capture raises (fx/capture.py): export's own reason with what to do, or, where
the failure has a cause export does not name, that cause (a PackedSequence in the forward, a padded
member's refusal of the inputs)."""

from __future__ import annotations

import traceback
from typing import Any

from torch import nn

from ..errors import WideCompileError
from .source import is_user_file, location

__all__ = ["capture_error", "explicit_generator_error", "outside_padded_program"]


def explicit_generator_error(model: nn.Module, where: str) -> WideCompileError:
    """The refusal of a member that draws random numbers with an explicit ``generator=`` (``where``:
    the ops and lines, or why export stopped): Note [Random ops per member] in
    fx/rules/randomness.py."""
    return WideCompileError(
        f"wide_compiler: member 0 ({type(model).__name__}) draws random numbers with an explicit generator= "
        f"({where}): each member alone advances its own generator, and the wide model, which draws for every "
        "member at once, would have one, so its draws could not be any member's.\n"
        "What to do: draw from the default generator (seed it with torch.manual_seed), or keep the module "
        "whole with @wide_compiler.register(ModuleType).")


def capture_error(model: nn.Module, e: Exception, compiling: Any = ()) -> WideCompileError:
    """The error for a failed export of ``model``: what, why and what to do (a PackedSequence, a
    padded member's own refusal, a dynamic_shapes mismatch, else export's reason with the advice)."""
    packed = _packed_sequence_use(model, e)
    if packed is not None:
        return packed
    padded = outside_padded_program(e)
    if padded is not None:  # a padded member refused the inputs, saying why: that alone (probe 9, P9-4)
        return WideCompileError(str(padded))
    if "argument of type: <class 'torch._C.Generator'>" in str(e):  # a GPU's generator: export stops at it
        return explicit_generator_error(model, f"{_user_line(e) or 'a torch.Generator argument'}, which torch.export "
                                               f"cannot take: {e}")
    what = f"wide_compiler: torch.export could not capture {type(model).__name__}: {type(e).__name__}: {e}\n"
    if compiling:
        what += (f"The forward asks torch.compiler.is_compiling() ({'; '.join(dict.fromkeys(compiling))}): the "
                 "capture follows the branch each member takes when called alone (the answer False, Note [What "
                 "export does not capture] in fx/export_watch.py), and that branch is what failed above.\n")
    if _in_frames(e, "_detect_is_causal_mask"):  # probe 20 of issue 44, P20-6
        return WideCompileError(
            what + "It fails in torch's _detect_is_causal_mask: nn.TransformerEncoder (and nn.Transformer) given a "
            "float mask but no is_causal compares the mask's values with a causal mask to decide, a check on "
            "tensor values that export cannot trace.\nWhat to do: say it in the call, enc(x, mask=mask, "
            "is_causal=True) for a causal mask (the same values), or is_causal=False for another.")
    if "dynamic_shapes" in str(e) or "tree_name" in str(e):
        return WideCompileError(
            what + "What to do: the dynamic_shapes given to torch.export do not match the forward's "
            "inputs. Pass compile(..., dynamic_shapes=...) nested exactly as the forward's parameters "
            "(one entry per parameter; for a forward(*args) a tuple under the parameter's name), or leave "
            "it out: compile() then marks dim 0 of every input dynamic itself, for *args and **kwargs "
            "forwards too.")
    return WideCompileError(
        what + "What to do: make the forward exportable (no data-dependent Python control flow on "
        "tensor values: use torch.cond, or restructure), register a wide form for the "
        "offending module with @wide_compiler.register(ModuleType) so it is kept whole, or "
        "pass dynamic_shapes= to compile() if the batch is not dim 0 of every input.")


def _user_line(e: BaseException) -> str | None:
    """``at file:line in func: code`` of the innermost frame of the user's code ``e`` was raised
    through (None when there is none)."""
    frames = [(f.f_code.co_filename, line, f.f_code.co_name) for f, line in traceback.walk_tb(e.__traceback__)]
    user = [f for f in frames if is_user_file(f[0], skip_stdlib=True)]
    return f"at {location(*user[-1])}" if user else None


def _in_frames(e: BaseException | None, name: str) -> bool:
    """Whether a function called ``name`` is among the frames ``e`` (or one of its causes) was raised through."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(f.f_code.co_name == name for f, _ in traceback.walk_tb(e.__traceback__)):
            return True
        e = e.__cause__ or e.__context__
    return False


def outside_padded_program(e: BaseException | None) -> BaseException | None:
    """The OutsidePaddedProgram among ``e`` and its causes (a padded member's check of its
    program's assumptions, Note [A padded program's assumptions] in padded_members.py), or None:
    its message says what, where and what to do; export's advice does not apply."""
    from .padded_members import OutsidePaddedProgram

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OutsidePaddedProgram):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _packed_sequence_use(model: nn.Module, e: BaseException) -> WideCompileError | None:
    """The error for a forward that made a ``PackedSequence`` (``pack_padded_sequence``,
    ``pack_sequence``) when capture failed on it (export's own error names neither), or None: the
    frames of the failure are searched for one holding a PackedSequence."""
    from torch.nn.utils.rnn import PackedSequence

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = list(traceback.walk_tb(e.__traceback__))
        for k in reversed(range(len(frames))):  # the innermost frame that holds one
            frame = frames[k][0]
            if not any(isinstance(v, PackedSequence) for v in frame.f_locals.values()):
                continue
            user = [(f, line) for f, line in frames[:k + 1] if is_user_file(f.f_code.co_filename)]
            where = "<no source line recorded>"
            if user:
                f, line = user[-1]
                where = location(f.f_code.co_filename, line, f.f_code.co_name)
            owner = frame.f_locals.get("self")
            path = next((name for name, m in model.named_modules() if m is owner), None) \
                if isinstance(owner, nn.Module) else None
            module = f" (module {path or 'the model'!r}, {type(owner).__name__})" if path is not None else ""
            return WideCompileError(
                f"wide_compiler: cannot capture {type(model).__name__}: its forward uses a "
                f"torch.nn.utils.rnn.PackedSequence (from pack_padded_sequence / pack_sequence) at "
                f"{where}{module}.\n"
                "Why: a PackedSequence's layout (batch_sizes, sorted indices) is computed from the values "
                "of the lengths, which torch.export cannot trace (it runs the forward on fake tensors, "
                "and every member must run the same program whatever its lengths).\n"
                "What to do: run the recurrent layer on the padded batch and mask the padding instead: "
                "out, _ = self.rnn(x); take each sequence's last valid step with "
                "out[torch.arange(x.shape[0]), lengths - 1] (batch_first, one direction), or multiply "
                "out by a mask (torch.arange(T) < lengths[:, None]); or keep the module whole with "
                "@wide_compiler.register(ModuleType).")
        e = e.__cause__ or e.__context__
    return None
