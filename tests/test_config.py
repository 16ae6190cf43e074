"""FSDP2Config (design spec §4.3, §15): defaults, fail-fast keys, world-size resolution."""

from __future__ import annotations

import dataclasses

import pytest

from lp_lightning.config import FSDP2Config


def test_defaults_and_seed_node_values():
    assert FSDP2Config() == FSDP2Config(dp_shard_size=None, reshard_after_forward=True, comm_fusion=False,
                                        fallback_to_unsharded=False)
    node = FSDP2Config(dp_shard_size=8)
    assert node.resolve_dp_shard_size(8) == 8 and FSDP2Config().resolve_dp_shard_size(3) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.comm_fusion = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"comm_fusion": True}, ValueError, r"fsdp_config.comm_fusion=true is not supported \(design spec §15"),
        ({"tensor_parallel_size": 2}, ValueError, r"fsdp_config.tensor_parallel_size=2 is not supported"),
        ({"context_parallel_size": 4}, ValueError, r"fsdp_config.context_parallel_size=4"),
        ({"expert_parallel_size": 8}, ValueError, r"fsdp_config.expert_parallel_size=8"),
        ({"pipeline_parallel_size": 2}, ValueError, r"fsdp_config.pipeline_parallel_size=2"),
        ({"dp_shard_size": 0}, ValueError, r"fsdp_config.dp_shard_size must be >= 1"),
        ({"dp_shard_size": "8"}, TypeError, r"fsdp_config.dp_shard_size must be an int"),
        ({"reshard_after_forward": "false"}, TypeError, r"fsdp_config.reshard_after_forward must be a bool"),
    ],
)
def test_unsupported_values_name_the_key(kwargs, error, message):
    with pytest.raises(error, match=message):
        FSDP2Config(**kwargs)


def test_dp_shard_size_must_equal_world_size():
    with pytest.raises(ValueError, match=r"dp_shard_size=8 does not match the world size 2.*--trainer.devices 8"):
        FSDP2Config(dp_shard_size=8).resolve_dp_shard_size(2)


def test_activation_checkpoint_modes_have_one_definition():
    from typing import get_args

    from lp_lightning.config import ACTIVATION_CHECKPOINT_MODES, ActivationCheckpointMode, check_activation_checkpoint

    assert ACTIVATION_CHECKPOINT_MODES == get_args(ActivationCheckpointMode) == ("off", "full")
    assert [check_activation_checkpoint(m) for m in ACTIVATION_CHECKPOINT_MODES] == ["off", "full"]
    with pytest.raises(ValueError, match=r"^model.activation_checkpoint must be 'off' or 'full', got 'selective'; "
                                         r"design spec §15"):
        check_activation_checkpoint("selective", "model.activation_checkpoint")
