"""``LowPrecisionLinear``: an ``nn.Linear`` whose three GEMMs run in MXFP8 or HiF8 (design spec §5.1, §8).

``replace_low_precision_linear(source, fqn=..., policy=...)`` is the replacement-plan factory for
exact ``nn.Linear`` targets (MLA projections, the dense MLP, shared experts; see
``lp_lightning.plan``). The new module:

- registers the *same* ``Parameter`` objects as ``source`` (no copy, no re-init; built on the meta
  device, so nothing is allocated), in the same order, so FQNs, ``state_dict`` keys, parameter
  sharing and ``requires_grad`` are unchanged; the bias stays high precision;
- keeps ``source``'s ``training`` flag and any other plain attribute it carries (e.g. HF's
  ``_is_hf_initialized``), and adds ``policy``, ``recipe`` and ``fqn`` as plain attributes;
- has ``nn.Linear``'s ``forward(input)`` signature; forward runs
  ``lp_lightning.functional.low_precision_linear`` (fprop INPUT_FWD × WEIGHT_FWD, dgrad
  GRAD_OUTPUT × WEIGHT_BWD, wgrad GRAD_OUTPUT × INPUT_BWD, all low precision).

The weight the GEMMs read is the persistent low-precision weight derived from the FP32 master
(``lp_lightning.fsdp.weights.finalize_low_precision_weights``, which finds it through the class
attributes ``low_precision_weight_names``/``low_precision_weight_kind``), installed once after the
plan is applied (design spec §7.2–7.3); until then ``forward`` raises ``TypeError`` naming the module's
FQN — there is no high-precision fallback.
"""

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from lp_lightning.formats.recipe import LowPrecisionRecipe, recipe_for
from lp_lightning.functional.linear import low_precision_linear, selects_low_precision_operand
from lp_lightning.policy import LowPrecisionPolicy

__all__ = ["LowPrecisionLinear", "replace_low_precision_linear"]


def check_factory_arguments(
    who: str, source: nn.Module, expected: type, fqn: object, policy: object, *, require_policy: bool = True
) -> None:
    """Validate a replacement factory's arguments (shared by the Linear and experts factories).

    Args:
        who: Factory name for messages.
        source: The module to replace; must be exactly of type ``expected``.
        expected: The required class (subclasses and wrappers are rejected: they change
            behaviour the low-precision module would not keep).
        fqn: The module's fully qualified name; a non-empty ``str``.
        policy: A ``LowPrecisionPolicy`` with ``enabled=True``.
        require_policy: ``False`` for constructors that take a recipe instead (``policy`` unused).

    Raises:
        TypeError: naming the FQN, for a ``source`` of another type (incl. subclasses) or a
            ``policy`` that is not a ``LowPrecisionPolicy``; for a non-``str`` ``fqn``.
        ValueError: for an empty ``fqn`` or a disabled policy.
    """
    if not isinstance(fqn, str):
        raise TypeError(f"{who}: fqn must be the module's fully qualified name (a str), got {type(fqn).__name__}.")
    if not fqn:
        raise ValueError(f"{who}: fqn must be the module's non-empty fully qualified name, got ''.")
    if type(source) is not expected:
        raise TypeError(
            f"{who}: module {fqn!r} is a {type(source).__module__}.{type(source).__qualname__}; only an exact "
            f"{expected.__module__}.{expected.__qualname__} can be replaced. Exclude this FQN from the rule."
        )
    if not require_policy:
        return
    if not isinstance(policy, LowPrecisionPolicy):
        raise TypeError(
            f"{who}: policy for {fqn!r} must be an lp_lightning.policy.LowPrecisionPolicy, got {type(policy).__name__}."
        )
    if not policy.enabled:
        raise ValueError(
            f"{who}: policy.enabled is False for {fqn!r}; a disabled policy replaces nothing "
            "(the plan skips low_precision rules when low precision is off)."
        )


def copy_plain_attributes(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` every instance attribute of ``source`` that it lacks (e.g. HF's flags).

    ``target`` is an initialized ``nn.Module``, so its ``__dict__`` already holds the module
    internals (``_parameters``, hooks, ``training``, ...); what is left in ``source.__dict__`` are
    plain attributes set by the source's class or by tools (``config``, ``_is_hf_initialized``).
    Values are shared, not copied.
    """
    for name, value in vars(source).items():
        if name not in vars(target):
            object.__setattr__(target, name, value)


class LowPrecisionLinear(nn.Linear):
    """``nn.Linear`` with fprop, dgrad and wgrad as MXFP8 or HiF8 GEMMs (design spec §8).

    Build it with ``replace_low_precision_linear`` (direct construction is not supported: the
    module always takes over an existing ``nn.Linear``'s parameters).

    Attributes:
        in_features, out_features: As ``nn.Linear``.
        weight: The source's weight ``Parameter`` ``[out_features, in_features]``; after the
            low-precision weights are built, a tensor whose ``select(orientation)`` yields the
            quantized operands.
        bias: The source's bias ``Parameter`` ``[out_features]`` or None; stays high precision.
        policy: The ``LowPrecisionPolicy`` the module was built with (``None`` from :meth:`from_linear`).
        recipe: The ``LowPrecisionRecipe`` of ``policy.format`` (per-role quantizers).
        fqn: The module's fully qualified name in the model (for messages and reports).
        low_precision_weight_names: Class attribute ``("weight",)``: the parameter that
            ``lp_lightning.fsdp.weights.finalize_low_precision_weights`` turns into a persistent
            low-precision weight (``low_precision_weight_kind = "dense"``: GEMM view ``[N, K]``).
    """

    low_precision_weight_names: ClassVar[tuple[str, ...]] = ("weight",)
    low_precision_weight_kind: ClassVar[str] = "dense"
    policy: "LowPrecisionPolicy | None"
    recipe: LowPrecisionRecipe
    fqn: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "LowPrecisionLinear is built from an nn.Linear: use "
            "lp_lightning.modules.replace_low_precision_linear(source, fqn=..., policy=...) or "
            "LowPrecisionLinear.from_linear(source, fqn=..., recipe=...)."
        )

    @classmethod
    def from_linear(cls, source: nn.Linear, *, fqn: str, recipe: LowPrecisionRecipe) -> "LowPrecisionLinear":
        """A ``LowPrecisionLinear`` computing with ``recipe`` that takes over ``source``'s parameters.

        The format-agnostic constructor (any registered format's recipe); the replacement plan's
        factory :func:`replace_low_precision_linear` calls it with the policy's recipe.
        ``source`` is not modified: the new module is built on the meta device and registers
        ``source.weight`` and ``source.bias`` — the same ``Parameter`` objects.

        Args:
            source: An exact ``torch.nn.Linear``.
            fqn: The module's fully qualified name (non-empty).
            recipe: A ``LowPrecisionRecipe``.

        Raises:
            TypeError: ``source`` is not exactly ``nn.Linear`` or ``recipe`` is not a recipe.
            ValueError: an empty ``fqn``.
        """
        check_factory_arguments("LowPrecisionLinear.from_linear", source, nn.Linear, fqn, None, require_policy=False)
        if not isinstance(recipe, LowPrecisionRecipe):
            raise TypeError(f"LowPrecisionLinear.from_linear({fqn!r}): recipe must be a LowPrecisionRecipe, got {recipe!r}.")
        module = cls.__new__(cls)
        with torch.device("meta"):
            nn.Linear.__init__(module, source.in_features, source.out_features, bias=source.bias is not None)
        module.weight = source.weight
        if source.bias is not None:
            module.bias = source.bias
        copy_plain_attributes(source, module)
        module.policy = None
        module.recipe = recipe
        module.fqn = fqn
        module.training = source.training
        return module

    def forward(self, input: Tensor) -> Tensor:
        """``input · weightᵀ + bias`` with low-precision GEMMs.

        Args:
            input: ``[..., in_features]`` activation (e.g. ``[B, S, K]`` or ``[M, K]``).

        Returns:
            ``[..., out_features]`` in the activation dtype (autocast's if on, else ``input``'s).

        Raises:
            TypeError: if the persistent low-precision weight has not been built yet.
        """
        if not selects_low_precision_operand(self.weight):
            raise TypeError(
                f"LowPrecisionLinear {self.fqn!r}: weight is still the plain high-precision Parameter "
                f"{tuple(self.weight.shape)}; build the {self.recipe.format.name} weight after applying the plan "
                "with lp_lightning.fsdp.weights.finalize_low_precision_weights."
            )
        return low_precision_linear(input, self.weight, self.bias, recipe=self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.recipe.format.name}, fqn={self.fqn!r}"


def replace_low_precision_linear(source: nn.Linear, *, fqn: str, policy: LowPrecisionPolicy) -> LowPrecisionLinear:
    """Replacement factory: a ``LowPrecisionLinear`` that takes over ``source``'s parameters.

    ``source`` is not modified. The new module is built on the meta device (nothing allocated,
    nothing initialized) and then registers ``source.weight`` and ``source.bias`` — the same
    ``Parameter`` objects.

    Args:
        source: An exact ``torch.nn.Linear`` (``type(source) is nn.Linear``).
        fqn: The module's fully qualified name, e.g. ``"model.layers.0.self_attn.q_proj"``.
        policy: An enabled ``LowPrecisionPolicy``; its ``format`` picks the recipe
            (``recipe_for(policy.format, policy.backend)``).

    Returns:
        The new ``LowPrecisionLinear`` (same ``training`` flag).

    Raises:
        TypeError: if ``source`` is not exactly ``nn.Linear`` (message names ``fqn``), or
            ``policy`` is not a ``LowPrecisionPolicy``.
        ValueError: for an empty ``fqn`` or a disabled policy.
    """
    check_factory_arguments("replace_low_precision_linear", source, nn.Linear, fqn, policy)
    module = LowPrecisionLinear.from_linear(source, fqn=fqn, recipe=recipe_for(policy.format, policy.backend))
    module.policy = policy
    return module
