"""Recipe for any gated MLP, recognised by its structure, not by its family:

    down(dropout(act(gate(x)) * up(x)))                 separate projections (Llama, Qwen3, EuroBERT,
                                                        Gemma3, NomicBERT, GTE: gate_proj/up_proj/down_proj)
    down(dropout(act(a) * b)), a, b = fused(x).chunk(2)  one projection, either half the gate
                                                        (ModernBERT's Wi/Wo, Phi-3's gate_up_proj)

with act SiLU (SwiGLU), exact or tanh GELU (GeGLU), biases or not, the dropout optional. It becomes a
``GatedMLP`` (tempo.ops.gated_mlp: the activation, product, dropout and down projection as one
``gated_linear`` op keeping the gate and up pre-activations only, 2·I per token instead of 4·I)
holding the same submodules in the original's order. A new family built this way gets Tempo
without a file of its own.

Recognised (cheap, structural): a module whose children are Linear layers (``nn.Linear``, or a
module with integer ``in_features``/``out_features`` such as PEFT's LoRA layers), exactly one
parameter-free module (the activation) and at most one ``nn.Dropout``, nothing else; the Linears
are three, two of the same shape h -> I and one I -> h' (gate, up, down), or two, h -> 2·I and
I -> h' (fused, down). Then, in ``build``:

  * the activation's form is measured (tempo.integrations.layers' probes, float64 over [-8, 8]
    and out to ±1e4: SiLU, exact GELU, tanh GELU); another one (ReLU, QuickGELU, a clipped GELU)
    is left alone, logged;
  * which projection (or which half) is the gate is measured: each assignment is run against the
    original on a small random input (``same_output``, eval mode), names first where they say it
    (``KNOWN_SEPARATE``, ``KNOWN_FUSED``); the first that computes what the original does is
    taken. None does: the module looks gated but computes something else, and is left alone with
    one line naming its class and why;
  * a dropout must be the one between the product and the down projection: its input, seen by a
    hook while the original runs, must be the product; else the module is left alone, logged.

The activation holds no state, so its form is measured on the CPU even for a model on the meta
device; which projection is the gate cannot be: there the layout follows ``KNOWN_SEPARATE`` /
``KNOWN_FUSED`` (or the one assignment the shapes allow), else the module is left alone, logged.
An activation called as a plain function (``F.silu(...)`` in the forward, no module) is not
recognised: without an activation child, three same-shaped Linears are as likely an attention.

The replacement is an instance of the original class too (``as_original_class``), so the model's
``_init_weights`` initialises it as the original (ModernBERT's ``Wo`` std, say); ``revert_tempo``
hands back the replacement's current submodules (LoRA-wrapped ones included) to the original.
Turned on by ``apply_tempo``'s ``gelu`` option (the activation layers' option).
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch import nn

from tempo.integrations.layers import _probe_gelu_form, computes_silu
from tempo.integrations.recipe import Options, Recipe, Skip, has_meta_weights, restore_children, same_output, sample

KIND = "gated MLP"

# Names that say the layout where the structure alone cannot (which of two same-shaped projections,
# or which half of a fused one, is the gate). A guess to try first when weights exist; the layout
# itself on the meta device. (gate, up) of separate projections; fused name -> index of the gate half.
KNOWN_SEPARATE = {("gate_proj", "up_proj"), ("fc12", "fc11"), ("w1", "w3"), ("wi_0", "wi_1")}
KNOWN_FUSED = {"Wi": 0, "gate_up_proj": 0, "up_gate_proj": 1}


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (isinstance(getattr(module, "in_features", None), int)
                                             and isinstance(getattr(module, "out_features", None), int))


def _parts(module: nn.Module) -> Optional[tuple[list[str], Optional[str], Optional[str]]]:
    """(Linear children's names, the activation's name, the dropout's name) when the children are
    Linears, one parameter-free module and at most one nn.Dropout; else None."""
    linears, others, dropouts = [], [], []
    for name, child in module._modules.items():
        if child is None:
            continue
        if _linear_like(child):
            linears.append(name)
        elif isinstance(child, nn.Dropout):
            dropouts.append(name)
        else:
            others.append(name)
    if len(others) != 1 or len(dropouts) > 1 or len(linears) not in (2, 3):
        return None
    act = module._modules[others[0]]
    if any(True for _ in act.parameters()) or any(True for _ in act.buffers()) or act._modules:
        return None
    return linears, others[0], (dropouts[0] if dropouts else None)


def _shape(module: nn.Module) -> tuple[int, int]:
    return module.in_features, module.out_features


def _assignments(module: nn.Module, linears: list[str]) -> list[dict]:
    """Every (gate, up, down) or (fused, gate_half, down) the Linears' shapes allow, named layouts first."""
    m = module._modules
    found = []
    if len(linears) == 3:
        for down in linears:
            a, b = [n for n in linears if n != down]
            if _shape(m[a]) == _shape(m[b]) and m[a].out_features == m[down].in_features:
                pairs = [(a, b), (b, a)]
                pairs.sort(key=lambda gu: gu not in KNOWN_SEPARATE)
                found += [dict(gate=g, up=u, down=down) for g, u in pairs]
    else:
        for fused, down in itertools.permutations(linears):
            if m[fused].out_features == 2 * m[down].in_features:
                halves = [0, 1] if KNOWN_FUSED.get(fused, 0) == 0 else [1, 0]
                found += [dict(fused=fused, gate_half=half, down=down) for half in halves]
    return found


def _recognise(module: nn.Module) -> bool:
    parts = _parts(module)
    return parts is not None and bool(_assignments(module, parts[0]))


def _activation_form(act: nn.Module) -> Optional[str]:
    """"silu", "gelu", "gelu_tanh" or None, measured (float64 on the CPU: it holds no state)."""
    if computes_silu(act):
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh", None: None}[_probe_gelu_form(act)]


def _first_weight(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


def _check_input(original: nn.Module, layout_first: str) -> torch.Tensor:
    projection = original._modules[layout_first]
    return sample((2, 3, projection.in_features), _first_weight(projection))


def _dropout_sees_the_product(original: nn.Module, replacement: nn.Module, x: torch.Tensor) -> bool:
    """The original's dropout receives act(gate) * up (checked in eval mode, where it is the identity)."""
    from tempo.ops.gated_mlp import _act_reference

    layout = replacement.layout
    seen = []
    handle = original._modules[layout.dropout].register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    modes = [(m, m.training) for m in original.modules()]
    original.eval()
    try:
        with torch.no_grad():
            original(x)
            m = original._modules
            if layout.fused is not None:
                first, second = m[layout.fused](x).chunk(2, dim=-1)
                gate, up = (first, second) if layout.gate_half == 0 else (second, first)
            else:
                gate, up = m[layout.gate](x), m[layout.up](x)
            product = _act_reference(gate, layout.activation) * up
    except Exception:  # noqa: BLE001 - a forward we cannot run is one we do not replace
        return False
    finally:
        handle.remove()
        for module, mode in modes:
            module.training = mode
    if len(seen) != 1 or not isinstance(seen[0], torch.Tensor) or seen[0].shape != product.shape:
        return False
    # The same ops in the same dtype, give or take an activation written another way: a few ULP.
    tol = 1e-5 if product.dtype in (torch.float32, torch.float64) else 8 * torch.finfo(product.dtype).eps
    return bool(torch.allclose(seen[0].to(product.dtype), product, rtol=tol, atol=tol))


def _build(old: nn.Module, options: Options) -> nn.Module | Skip:
    from tempo.ops.gated_mlp import GatedLayout, GatedMLP

    cls = type(old).__name__
    linears, act_name, dropout = _parts(old)
    meta = has_meta_weights(old)
    activation = _activation_form(old._modules[act_name])
    if activation is None:
        return Skip(f"{cls}: its activation {type(old._modules[act_name]).__name__} is none of SiLU, exact or "
                    f"tanh GELU")
    candidates = [GatedMLP(old, GatedLayout(activation=activation, act=act_name, dropout=dropout, **a))
                  for a in _assignments(old, linears)]
    if meta:
        named = [c for c in candidates if (c.layout.gate, c.layout.up) in KNOWN_SEPARATE
                 or KNOWN_FUSED.get(c.layout.fused) == c.layout.gate_half]
        if len(named) == 1 or len(candidates) == 1:
            return (named or candidates)[0]
        return Skip(f"{cls}: on the meta device which projection is the gate cannot be measured, and its "
                    f"names ({', '.join(linears)}) are not a known layout")
    x = _check_input(old, candidates[0].layout.fused or candidates[0].layout.gate)
    refusals = []
    for candidate in candidates:
        checked = same_output(old, candidate, x)
        if checked:
            if dropout is not None and not _dropout_sees_the_product(old, candidate, x):
                return Skip(f"{cls}: its dropout {dropout} is not applied to the gated product")
            return candidate
        refusals.append(getattr(checked, "reason", ""))
    return Skip(f"{cls}: looks like a gated MLP but computes something else (its output is not "
                f"down({activation}(gate(x)) * up(x)) for any assignment of {', '.join(linears)})",
                measured="; ".join(r for r in refusals if r))


def _check(original: nn.Module, replacement: nn.Module) -> bool:
    if has_meta_weights(original):
        return True  # nothing to compute with yet: the structure and names were checked
    layout = replacement.layout
    return same_output(original, replacement, _check_input(original, layout.fused or layout.gate))


def _label(new: nn.Module) -> tuple[str, str]:
    names = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "tanh GeGLU"}
    return f"{KIND} ({names[new.layout.activation]})", "GatedMLP (gated_linear: keeps gate and up only)"


def gated_mlp_recipes() -> list[Recipe]:
    from tempo.ops.gated_mlp import GatedMLP

    return [Recipe(kind=KIND, becomes="GatedMLP (gated_linear: keeps gate and up only)", option="gelu",
                   replacement=GatedMLP, recognise=_recognise, build=_build, check=_check, restore=restore_children,
                   label=_label)]


__all__ = ["KNOWN_FUSED", "KNOWN_SEPARATE", "gated_mlp_recipes"]
