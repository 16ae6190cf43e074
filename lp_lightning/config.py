"""Run-level configuration of the FSDP2 job: the ``fsdp_config`` section (design spec §4.3, §15).

This module holds plain, frozen, validated dataclasses. jsonargparse builds the CLI/YAML section
from their type hints (``lp-lightning fit --fsdp_config.reshard_after_forward false``), and every
check runs in ``__post_init__``, i.e. while the config is parsed and before any process group,
model or optimizer exists (design spec §15: unsupported values fail at startup, naming the key).

YAML (design spec §4.3, the 16B node)::

    fsdp_config:
      dp_shard_size: 8
      reshard_after_forward: true
      comm_fusion: false
      fallback_to_unsharded: false
      input_dim_sharding: true

Only 1-D data-parallel sharding (FSDP2 over a ``("dp_shard",)`` mesh) is supported; the
tensor/context/expert/pipeline parallel degrees exist as keys only so that a config asking for
them fails loudly instead of being ignored (design spec §15 "TP/CP/EP/PP 均为 1").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["ACTIVATION_CHECKPOINT_MODES", "ActivationCheckpointMode", "FSDP2Config", "check_activation_checkpoint"]

ActivationCheckpointMode = Literal["off", "full"]
"""Activation recomputation per decoder layer (design spec §15 "Recompute: off, full")."""

ACTIVATION_CHECKPOINT_MODES: tuple[ActivationCheckpointMode, ...] = get_args(ActivationCheckpointMode)
"""The values of :data:`ActivationCheckpointMode`, ``("off", "full")``."""


def check_activation_checkpoint(value: object, name: str = "activation_checkpoint") -> ActivationCheckpointMode:
    """``value`` if it is an :data:`ActivationCheckpointMode`.

    Args:
        value: The recompute setting.
        name: The setting as the caller spells it in the message (``model.activation_checkpoint``).

    Raises:
        ValueError: any other value (design spec §15: no other recompute policy).
    """
    if value not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(
            f"{name} must be 'off' or 'full', got {value!r}; design spec §15 allows no other recompute policy."
        )
    return value

_UNSUPPORTED_PARALLEL_DEGREES = (
    "tensor_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "pipeline_parallel_size",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDP2Config:
    """The ``fsdp_config`` section: how FSDP2 shards the model (design spec §4.3, §9, §15).

    Args:
        dp_shard_size: Number of ranks the parameters are sharded over (the size of the 1-D
            ``("dp_shard",)`` device mesh). ``None`` means "the world size". When given it must
            equal the world size (there is no replicate dimension); the strategy checks that once
            the process group exists.
        reshard_after_forward: FSDP2 ``reshard_after_forward``: free the all-gathered parameters
            after each layer's forward and all-gather them again in backward (``True``, ZeRO-3
            style), or keep them until backward (``False``, ZeRO-2 style, more memory, less
            communication). Issue 4 uses it to choose which MXFP8 orientation is gathered (R7).
        comm_fusion: Fusing FSDP collectives across layers. Unsupported (design spec §15): ``True``
            raises here.
        fallback_to_unsharded: What to do with a low-precision weight that no dim can shard
            legally (design spec §9.1; docs/architecture.md "Placements"): ``False`` fails at
            startup, ``True`` keeps that weight replicated (it still computes in low precision).
            In the ``bf16`` precision there is no such rule, every parameter is sharded and the
            flag has no effect; it is read by the low-precision sharding check.
        input_dim_sharding: Shard a weight whose dim-0 split breaks its format's rule (MXFP8:
            rows per rank a multiple of 64) along its input dimension instead (FSDP2 ``Shard(1)``,
            where that split is legal). ``False`` treats such weights as unshardable (replicated
            with ``fallback_to_unsharded``, else an error): the behaviour before placements, kept to
            compare the two.
        tensor_parallel_size: Must be 1 (design spec §15).
        context_parallel_size: Must be 1 (design spec §15).
        expert_parallel_size: Must be 1 (design spec §15).
        pipeline_parallel_size: Must be 1 (design spec §15).

    Raises:
        TypeError: A field has the wrong type (e.g. ``dp_shard_size: "8"`` or
            ``comm_fusion: "false"``, which would be truthy).
        ValueError: ``dp_shard_size < 1``, ``comm_fusion`` is true, or a parallel degree other
            than data parallel is not 1. The message names the ``fsdp_config.<key>``.
    """

    dp_shard_size: int | None = None
    reshard_after_forward: bool = True
    comm_fusion: bool = False
    fallback_to_unsharded: bool = False
    input_dim_sharding: bool = True
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for key in ("reshard_after_forward", "comm_fusion", "fallback_to_unsharded", "input_dim_sharding"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise TypeError(
                    f"fsdp_config.{key} must be a bool, got {value!r} ({type(value).__name__}); "
                    f"write `{key}: true` or `{key}: false`."
                )
        if self.dp_shard_size is not None:
            if isinstance(self.dp_shard_size, bool) or not isinstance(self.dp_shard_size, int):
                raise TypeError(
                    f"fsdp_config.dp_shard_size must be an int or null, got {self.dp_shard_size!r} "
                    f"({type(self.dp_shard_size).__name__})."
                )
            if self.dp_shard_size < 1:
                raise ValueError(
                    f"fsdp_config.dp_shard_size must be >= 1 or null (= world size), got "
                    f"{self.dp_shard_size}."
                )
        if self.comm_fusion:
            raise ValueError(
                "fsdp_config.comm_fusion=true is not supported (design spec §15: FSDP communication "
                "fusion fails at startup); set `comm_fusion: false`."
            )
        for key in _UNSUPPORTED_PARALLEL_DEGREES:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"fsdp_config.{key} must be an int, got {value!r}.")
            if value != 1:
                raise ValueError(
                    f"fsdp_config.{key}={value} is not supported: only FSDP2 data-parallel "
                    f"sharding runs (design spec §15: TP/CP/EP/PP must all be 1); set `{key}: 1`."
                )

    def resolve_dp_shard_size(self, world_size: int) -> int:
        """Returns the mesh size for ``world_size`` ranks.

        Args:
            world_size: Number of processes in the default process group.

        Returns:
            ``dp_shard_size``, or ``world_size`` when it is ``None``.

        Raises:
            ValueError: ``dp_shard_size`` is set and differs from ``world_size``.
        """
        if self.dp_shard_size is None:
            return world_size
        if self.dp_shard_size != world_size:
            raise ValueError(
                f"fsdp_config.dp_shard_size={self.dp_shard_size} does not match the world size "
                f"{world_size}. Launch {self.dp_shard_size} processes (e.g. --trainer.devices "
                f"{self.dp_shard_size}) or set `dp_shard_size: null`."
            )
        return self.dp_shard_size
