"""The read-only probe callbacks (lp_lightning.telemetry.probe_callbacks; design spec §16.6, §17).

One in-process Trainer run per format (dsv3-tiny, 1-rank FSDP2 mesh, 2 optimizer steps — of 2
micro-batches in MXFP8, of 1 in HiF8, whose emulation is 4x slower on the CPU —, step 1 sampled,
every probe, a CSVLogger) and their files; the Fabric loop driving the same probes
through ``fabric.call``; one 2-process ``lp-lightning fit --precision hif8`` with the probes in a
YAML ``trainer.callbacks`` list (slow). The bf16 run with the probes is in tests/test_bf16_imports.py.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.lightning import LowPrecisionPlugin
from lp_lightning.telemetry import (
    GatherTraceProbe,
    GemmTraceProbe,
    ProfilerProbe,
    RefreshProbe,
    ScaleStatsProbe,
    StepRecordProbe,
)
from lp_lightning.telemetry.profile_probe import CATEGORIES

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = 21 + 2 * 2  # 21 replaced Linears + gate_up_proj and down_proj of the 2 routed-experts modules
GROUPED = {f"model.layers.{i}.mlp.experts.{n}" for i in (1, 2) for n in ("gate_up_proj", "down_proj")}
ROLES = ("dense_fprop", "dense_dgrad", "dense_wgrad", "grouped_fprop", "grouped_dgrad", "grouped_wgrad")
FORMAT = {"mxfp8": "mxfp8_e4m3", "hif8": "hif8"}
STEPS = 2
ACCUMULATE = {"mxfp8": 2, "hif8": 1}


def _probes(sample_every: int = 10) -> list:
    return [RefreshProbe(sample_every=sample_every), GemmTraceProbe(sample_every=sample_every),
            GatherTraceProbe(sample_every=sample_every), ScaleStatsProbe(sample_every=sample_every),
            StepRecordProbe(sample_every=sample_every), ProfilerProbe(start_step=2, steps=1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, token_cache_dir):
    """``runs(precision)`` -> (root, run summary, plugin): one Trainer run per format, cached."""
    cache: dict[str, tuple[Path, dict, LowPrecisionPlugin]] = {}

    def get(precision: str):
        if precision not in cache:
            root = tmp_path_factory.mktemp(precision)
            plugin = LowPrecisionPlugin(precision)
            env, threads = dict(os.environ), torch.get_num_threads()  # as the isolated_dist fixture
            try:
                _, _, summary = fit_tiny(
                    root, datamodule=tiny_datamodule(token_cache_dir), max_steps=STEPS,
                    accumulate_grad_batches=ACCUMULATE[precision],
                    plugin=plugin, callbacks=_probes(), logger=CSVLogger(root, name="logs"), log_every_n_steps=1,
                )  # fmt: skip
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
                os.environ.clear()
                os.environ.update(env)  # Lightning set MASTER_PORT, LOCAL_RANK, ... for its 1-rank group
                torch.set_num_threads(threads)
            cache[precision] = (root, summary, plugin)
        return cache[precision]

    return get


def _read(root: Path, kind: str, rank: int = 0) -> dict:
    data = json.loads((root / "probes" / f"{kind}_rank{rank}.json").read_text())
    assert data["kind"] == kind and data["rank"] == rank
    return data


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_refresh_once_per_weight_per_step_and_never_on_a_micro_step(runs, precision):
    root, summary, plugin = runs(precision)
    refresh = _read(root, "refresh")
    assert refresh["first_step"] == 1 and refresh["steps"] == STEPS and refresh["sampled_steps"] == [1]
    assert refresh["per_step"] == [{"step": s, "refreshes": WEIGHTS, "weights": WEIGHTS, "max_per_weight": 1,
                                    "skipped": False} for s in (1, 2)]
    assert refresh["micro_step_refreshes"] == 0 and refresh["forward_backward_refreshes"] == 0
    assert refresh["outside_steps"] == 0 and refresh["micro_batches_per_step"] == ACCUMULATE[precision]
    assert refresh["startup"] == 1 and refresh["resume"] == 0 and refresh["low_precision_weights"] == WEIGHTS
    assert [s["refreshes"] for s in refresh["per_step"]] == summary["refresh"]["per_step"]


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_gemm_trace_has_all_six_roles_with_the_weight_fqn_of_every_gemm(runs, precision):
    root, summary, plugin = runs(precision)
    trace = _read(root, "gemm_trace")
    fmt = FORMAT[precision]
    assert {key.split("|")[0] for key in trace["counts"]} == set(ROLES)
    assert all(key.endswith(f"|{fmt}|emulated") for key in trace["counts"])
    for role in ROLES:  # the run summary counts the same GEMMs
        assert trace["counts"][f"{role}|{fmt}|emulated"] == summary["kernels"][role.replace("_", ".", 1)]
    assert trace["unlabelled"] == 0 and sum(s["gemms"] for s in trace["per_step"]) == sum(trace["counts"].values())
    fqns = trace["weight_fqns"]
    assert set(fqns) == set(ROLES)
    assert set(fqns["grouped_fprop"]) == GROUPED and set(fqns["grouped_wgrad"]) == GROUPED
    assert set(fqns["dense_fprop"]) | GROUPED == set(plugin.low_precision_weights)
    assert fqns["dense_wgrad"] == fqns["dense_dgrad"] == fqns["dense_fprop"]  # wgrad named too
    events = trace["events"]
    assert {e["step"] for e in events} == {1}  # step 1 sampled, step 2 counted only
    assert {e["micro_batch"] for e in events} == set(range(ACCUMULATE[precision]))
    assert len(events) == trace["per_step"][0]["gemms"] == trace["per_step"][1]["gemms"]
    assert all(e["weight_fqn"] in plugin.low_precision_weights for e in events)
    wgrad = [e for e in events if e["role"] == "grouped_wgrad"]
    assert wgrad and all(e["layout"] == "TN" and e["num_groups"] == 8 and len(e["output_shape"]) == 3 for e in wgrad)


def test_hif8_scales_are_amax_over_format_max_per_role(runs):
    root, _, _ = runs("hif8")
    scales = _read(root, "scales")
    records = scales["records"]
    assert {r["step"] for r in records} == {1}
    expected_max = {"input_fwd": 15.0, "weight": 15.0, "grad_output": 224.0}
    assert {r["role"] for r in records} == set(expected_max)
    for record in records:
        assert record["format_max"] == expected_max[record["role"]], record
        assert record["matches"] is True and record["finite"] and record["positive"], record
        assert record["scale_dtype"] == "float32" and record["format"] == "hif8"
    # An independent check of one record: scale = float32(amax) / format_max, bit for bit.
    record = next(r for r in records if r["role"] == "grad_output")
    expected = torch.tensor(record["amax"], dtype=torch.float32) / 224.0
    assert torch.equal(torch.tensor(record["scale"], dtype=torch.float32), expected)
    weights = [r for r in records if r["role"] == "weight"]
    assert {r["weight_fqn"] for r in weights} == set(runs("hif8")[2].low_precision_weights)
    assert all(isinstance(r["scale"], list) and len(r["scale"]) == 8 for r in weights if r["weight_fqn"] in GROUPED)
    summary = scales["hif8"]
    assert set(summary) == set(expected_max)
    for role, entry in summary.items():
        assert entry["format_max"] == [expected_max[role]] and entry["all_match"] and entry["all_finite_positive"]
        assert entry["scale_max"] == pytest.approx(entry["amax_max"] / expected_max[role], rel=1e-6)
    assert scales["histograms"] == {} and scales["scale_dtype"] is None


def test_mxfp8_scales_are_e8m0_histograms_per_role(runs):
    root, _, _ = runs("mxfp8")
    scales = _read(root, "scales")
    assert scales["records"] == [] and scales["hif8"] == {}
    assert scales["scale_dtype"] == "float8_e8m0fnu"
    histograms = scales["histograms"]
    assert set(histograms) == {"input_fwd", "input_bwd", "grad_output", "weight"}
    for role, counts in histograms.items():
        assert sum(counts.values()) > 0 and all(0 <= int(b) <= 255 for b in counts), role
    assert "255" not in histograms["weight"]  # E8M0 NaN never appears in a finite weight's scales


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_gather_trace_has_pre_and_post_events_with_the_logical_weight(runs, precision):
    root, _, plugin = runs(precision)
    trace = _read(root, "gather_trace")
    # One process: FSDP2 copies locally; every weight is gathered in forward and backward, pre and post.
    gathers = ACCUMULATE[precision] * 2 * WEIGHTS
    assert trace["per_step"] == [{"step": s, "pre": gathers, "post": gathers} for s in (1, 2)]
    assert sum(runs(precision)[1]["wire"]["gathers_per_step"].values()) == gathers  # the wire counts pre only
    events = trace["events"]
    pre = [e for e in events if e["stage"] == "pre_all_gather"]
    post = [e for e in events if e["stage"] == "post_all_gather"]
    assert len(pre) == len(post) == ACCUMULATE[precision] * 2 * WEIGHTS  # step 1: every micro-batch, fwd + bwd
    assert all(e["local"] and e["sha1"] is None and e["tensors"][0][0] == "packed" for e in pre)
    assert {e["fqn"] for e in post} == set(plugin.low_precision_weights)
    for event in post:
        assert event["logical_dtype"] == "bfloat16" and len(event["logical_shape"]) in (2, 3)
        names = [name for name, _, _ in event["tensors"]]
        assert set(event["sha1"]) == set(names) and all(len(h) == 40 for h in event["sha1"].values())
        if precision == "hif8":
            assert names == ["data", "scale"] and event["orientations"] == ["row", "col"]
            data_shape, scale_shape = event["tensors"][0][2], event["tensors"][1][2]
            assert sorted(data_shape) == sorted(event["logical_shape"])
            assert len(event["scale_values"]) == (event["logical_shape"][0] if len(data_shape) == 3 else 1)
            assert scale_shape == ([] if len(data_shape) == 2 else [event["logical_shape"][0]])
        else:
            assert event["scale_values"] is None and len(event["orientations"]) == 1
            assert {dtype for _, dtype, _ in event["tensors"]} == {"float8_e4m3fn", "float8_e8m0fnu"}


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_step_records_and_profile_shares(runs, precision):
    root, summary, _ = runs(precision)
    steps = _read(root, "steps")
    records = steps["records"]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["loss"] for r in records] == summary["losses"]
    assert [r["grad_norm"] for r in records] == summary["grad_norms"]
    assert all(r["tokens"] == summary["tokens"] // STEPS and r["micro_batches"] == ACCUMULATE[precision]
               for r in records)
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_source"] == "ru_maxrss" and r["peak_memory_bytes"] > 0
               for r in records)
    assert steps["threads"]["torch_intra_op"] >= 1 and len(steps["load_average"]["end"]) == 3
    profile = _read(root, "profile")
    assert profile["window"] == [2, 2] and profile["complete"] and profile["steps_profiled"] == 1
    assert set(profile["shares"]) == set(profile["categories_s"]) == set(CATEGORIES)
    assert sum(profile["shares"].values()) == pytest.approx(1.0, abs=1e-9)
    seconds = profile["categories_s"]
    assert seconds["quantize"] > 0 and seconds["low_precision_mm"] > 0 and seconds["high_precision_mm"] > 0
    assert seconds["all_gather"] == 0  # one rank: FSDP2 copies locally, no all-gather range
    assert sum(seconds.values()) == pytest.approx(profile["wall_s"], rel=1e-9)
    assert 0 < profile["wall_s"] and len(profile["top_ops"]) == 20
    # A CPU run: the host ranges are the compute, labelled so (a device profile would say "device").
    assert (profile["source"], profile["activities"], profile["device_s"]) == ("host", ["CPU"], None)
    assert "CPU run" in profile["source_reason"] and profile["host_shares"] == profile["shares"]
    assert summary["time_shares"]["source"] == "host" and summary["time_shares"]["shares"] == profile["shares"]


def test_profile_categories_count_nested_ranges_once():
    from torch.profiler import ProfilerActivity, profile, record_function

    import lp_lightning.ops  # noqa: F401  (its labels are known once it is loaded, as in any low-precision run)
    from lp_lightning.telemetry.profile_probe import STEP_LABEL, categorise_profile

    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a @ a  # outside any step: not counted
        with record_function(STEP_LABEL):
            with record_function("lp_lightning::matmul"):
                a @ a  # low-precision MM time, not high-precision
            with record_function("FSDP::all_gather (model.layers.0)"):
                with record_function("lp_lightning::quantize"):
                    a + 1
            a @ a
    seconds, wall, steps = categorise_profile(prof.events())
    by_name = {}
    for event in prof.events():
        by_name.setdefault(event.name, []).append(event.time_range.elapsed_us() / 1e6)
    assert len(steps) == 1 and wall == pytest.approx(by_name[STEP_LABEL][0])
    assert seconds["low_precision_mm"] == pytest.approx(by_name["lp_lightning::matmul"][0])
    assert seconds["all_gather"] == pytest.approx(by_name["FSDP::all_gather (model.layers.0)"][0])
    assert seconds["quantize"] == 0  # inside the all-gather range
    outer_mm = [e for e in prof.events() if e.name == "aten::matmul" and e.cpu_parent is not None
                and e.cpu_parent.name == STEP_LABEL]
    assert seconds["high_precision_mm"] == pytest.approx(outer_mm[0].time_range.elapsed_us() / 1e6)
    assert sum(seconds.values()) == pytest.approx(wall)


def test_probe_scalars_reach_the_csv_logger(runs):
    root, _, _ = runs("hif8")
    (metrics,) = (root / "logs").glob("version_*/metrics.csv")
    with open(metrics) as handle:
        rows = list(csv.DictReader(handle))
    columns = set(rows[0])
    for name in ("probe/refreshes", "probe/gemms", "probe/gathers_pre", "probe/gathers_post", "probe/step_time_s",
                 "probe/tokens_per_s", "probe/peak_memory_bytes", "probe/scale/grad_output/amax_max",
                 "probe/scale/weight/scale_max", "probe/profile/quantize_share"):
        assert name in columns, name
    refreshes = [float(r["probe/refreshes"]) for r in rows if r["probe/refreshes"]]
    assert refreshes == [WEIGHTS] * STEPS


def test_fabric_drives_the_probes_through_fabric_call(tmp_path, isolated_dist):
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger as FabricCSVLogger

    from lp_lightning.lightning import FSDP2FabricStrategy, LowPrecisionFabricPlugin
    from lp_lightning.models.deepseek_v3 import from_hf_config

    probes = [RefreshProbe(sample_every=1), GemmTraceProbe(sample_every=1), ScaleStatsProbe(sample_every=1),
              GatherTraceProbe(sample_every=1), StepRecordProbe()]
    plugin = LowPrecisionFabricPlugin("mxfp8")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(), plugins=[plugin],
                    callbacks=probes, loggers=[FabricCSVLogger(tmp_path, name="logs")])
    fabric.launch()
    model = fabric.setup_module(from_hf_config("dsv3-tiny", seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids_BT = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    fabric.call("on_probe_start", model=model, fabric=fabric, out_dir=str(tmp_path / "probes"))
    for i in range(2):
        fabric.call("on_probe_step_start", step=i)
        logits = model(input_ids=ids_BT[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids_BT[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.call("on_probe_step_end", step=i, loss=loss, grad_norm=1.0, tokens=ids_BT[:, :-1].numel())
    with torch.no_grad():  # an evaluation forward outside a step is not attributed
        model(input_ids=ids_BT[:, :-1])
    fabric.call("on_probe_end")
    fabric.logger.finalize("success")
    refresh = _read(tmp_path, "refresh")
    assert [s["refreshes"] for s in refresh["per_step"]] == [WEIGHTS, WEIGHTS]
    assert refresh["micro_step_refreshes"] is None and refresh["forward_backward_refreshes"] == 0
    assert all(s["skipped"] is False for s in refresh["per_step"]) and refresh["startup"] == 1
    gemms = _read(tmp_path, "gemm_trace")
    assert {key.split("|")[0] for key in gemms["counts"]} == set(ROLES)
    assert gemms["per_step"][0]["gemms"] == gemms["per_step"][1]["gemms"]  # the eval forward is not in step 2
    assert set(_read(tmp_path, "scales")["histograms"]) == {"input_fwd", "input_bwd", "grad_output", "weight"}
    assert {e["stage"] for e in _read(tmp_path, "gather_trace")["events"]} == {"pre_all_gather", "post_all_gather"}
    steps = _read(tmp_path, "steps")["records"]
    assert [r["step"] for r in steps] == [1, 2] and all(r["tokens"] == 32 and r["grad_norm"] == 1.0 for r in steps)
    (metrics,) = (tmp_path / "logs").glob("version_*/metrics.csv")
    with open(metrics) as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["probe/refreshes"]) for r in rows if r.get("probe/refreshes")] == [WEIGHTS, WEIGHTS]


def test_probe_arguments_are_checked():
    with pytest.raises(ValueError, match="sample_every=0 must be an int >= 1"):
        RefreshProbe(sample_every=0)
    with pytest.raises(ValueError, match="start_step=0 must be an int >= 1"):
        ProfilerProbe(start_step=0)
    probe = StepRecordProbe()
    with pytest.raises(ValueError, match="pass out_dir"):
        probe.on_probe_start(rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="never started"):
        probe.on_probe_end()
    probe.on_probe_start(rank=0, world_size=1, out_dir="unused")
    with pytest.raises(ValueError, match="the open step is None"):
        probe.on_probe_step_end(step=0)


_PROBES_YAML = """\
trainer:
  callbacks:
    - class_path: lp_lightning.telemetry.RefreshProbe
    - class_path: lp_lightning.telemetry.GatherTraceProbe
      init_args: {sample_every: 1}
    - class_path: lp_lightning.telemetry.ScaleStatsProbe
    - class_path: lp_lightning.telemetry.StepRecordProbe
    - class_path: lp_lightning.telemetry.probes.HighPrecisionGemmProbe
    - class_path: lp_lightning.telemetry.LayerNumericsProbe
      init_args: {sample_every: 1, plot: false}
"""


@pytest.mark.slow
def test_two_process_cli_run_writes_per_rank_files_with_equal_gathered_weights(tmp_path, token_cache_dir):
    config = tmp_path / "probes.yaml"
    config.write_text(_PROBES_YAML)
    root = tmp_path / "run"
    command = [
        sys.executable, "-m", "lp_lightning.cli", "fit", "--config", str(REPO / "configs" / "dsv3_tiny.yaml"),
        "--config", str(config), "--precision", "hif8", "--trainer.devices", "2", "--trainer.max_steps", "2",
        "--trainer.default_root_dir", str(root), "--data.cache_dir", token_cache_dir, "--data.seq_len", "32",
        "--data.global_batch_size", "2", "--data.val_batches", "1", "--trainer.val_check_interval", "2",
        "--checkpoint.every_n_steps", "0", "--checkpoint.save_last", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((root / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["peak_memory_bytes_per_rank"]) == 2
    assert summary["peak_memory_bytes"] == max(summary["peak_memory_bytes_per_rank"])
    assert summary["kernels"]["high_precision_gemms_in_replaced_modules"] == 0
    files = {kind: [_read(root, kind, rank) for rank in (0, 1)] for kind in ("refresh", "gather_trace", "scales",
                                                                              "steps")}
    for kind, (zero, one) in files.items():
        assert zero["world_size"] == one["world_size"] == 2 and zero["steps"] == one["steps"] == 2, kind
    for rank_file in files["refresh"]:
        assert [s["refreshes"] for s in rank_file["per_step"]] == [WEIGHTS, WEIGHTS]
        assert rank_file["micro_step_refreshes"] == 0 and rank_file["forward_backward_refreshes"] == 0
    posts = [{(e["step"], e["fqn"], e["phase"]): e for e in f["events"] if e["stage"] == "post_all_gather"}
             for f in files["gather_trace"]]
    assert set(posts[0]) == set(posts[1]) and len(posts[0]) == 2 * 2 * WEIGHTS
    dense = [key for key in posts[0] if key[1] not in GROUPED]
    assert dense
    for key in posts[0]:  # every rank rebuilt the identical full weight (scales and codes)
        assert posts[0][key]["sha1"] == posts[1][key]["sha1"], key
        assert posts[0][key]["scale_values"] == posts[1][key]["scale_values"], key
    for key in dense:  # a dense HiF8 weight's per-tensor scale: one value, equal on both ranks
        assert len(posts[0][key]["scale_values"]) == 1 and not posts[0][key]["local"]
    for rank_file in files["scales"]:
        weights = [r for r in rank_file["records"] if r["role"] == "weight" and r["weight_fqn"] not in GROUPED]
        assert weights and all(r["amax_source"] == "event" and r["matches"] for r in weights)  # cross-rank MAX
    assert files["steps"][0]["records"][0]["loss"] == files["steps"][1]["records"][0]["loss"]
    # the layer numerics on sharded masters: each rank gathers every master whole (DTensor.full_tensor), so the
    # weight operands' cast statistics are the same on both ranks while the activations differ (other tokens)
    numerics = [_read(root, "layer_numerics", rank) for rank in (0, 1)]
    assert summary["layer_numerics"]["unmatched_operands"] == 0 and summary["layer_numerics"]["sampled_steps"] == [1, 2]
    for step in (0, 1):
        gemms = [f["records"][step]["gemms"] for f in numerics]
        assert gemms[0].keys() == gemms[1].keys() and len(gemms[0]) == 3 * WEIGHTS
        assert all(not f["records"][step]["unmatched_operands"] for f in numerics)
        for name in (n for n in gemms[0] if n.endswith("fprop")):
            assert gemms[0][name]["operands"]["weight"] == gemms[1][name]["operands"]["weight"], name
            assert gemms[0][name]["operands"]["activation"] != gemms[1][name]["operands"]["activation"], name
            assert gemms[0][name]["sqnr_db"] > 20 and gemms[1][name]["sqnr_db"] > 20, name


def _recorded_device_profile():
    """A device profile as ``torch.profiler`` hands it over (no GPU here): the real ``FunctionEvent`` s, host
    ranges with the kernels the profiler attaches to the launching op (``append_kernel``), linked into a tree
    by the profiler's own ``EventList._build_tree``. Times in µs; the kernels outlast their launches."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from lp_lightning.ops import trace
    from lp_lightning.telemetry.profile_probe import STEP_LABEL

    events, ids = [], iter(range(1, 100))

    def op(name, start, end, kernel_us=0.0):
        event = FunctionEvent(id=next(ids), name=name, thread=1, start_us=start, end_us=end, use_device="cuda")
        if kernel_us:
            event.append_kernel(f"{name}_kernel", 0, kernel_us)
            events.append(FunctionEvent(id=next(ids), name=f"{name}_kernel", thread=7, start_us=start,
                                        end_us=start + kernel_us, use_device="cuda", device_type=DeviceType.CUDA))
        events.append(event)

    op("aten::mm", 0, 50, kernel_us=999.0)  # before the step: not counted
    op(STEP_LABEL, 100, 1100)
    op(trace.MATMUL_LABEL, 110, 300)
    op("aten::mm", 120, 290, kernel_us=400.0)  # inside the low-precision GEMM range
    op(trace.QUANTIZE_LABEL, 300, 350)
    op("aten::abs", 310, 340, kernel_us=50.0)
    op("FSDP::all_gather (model.layers.0)", 350, 400)
    op("c10d::allgather_", 360, 390, kernel_us=600.0)  # the NCCL kernel: all-gather time
    op("aten::mm", 400, 450, kernel_us=100.0)  # outside every range: high precision
    op("aten::add_", 450, 460, kernel_us=20.0)  # other
    listed = EventList(sorted(events, key=lambda e: e.time_range.start), use_device="cuda")
    listed._build_tree()
    return listed


def test_profile_shares_come_from_device_kernels_when_the_profile_has_them():
    from lp_lightning.telemetry.profile_probe import time_shares

    figures = time_shares(_recorded_device_profile(), "cuda", device_recorded=True)
    assert figures["source"] == "device" and "cuda kernels" in figures["source_reason"]
    assert figures["device_s"] == pytest.approx(1170e-6)
    expected = {"low_precision_mm": 400e-6, "quantize": 50e-6, "all_gather": 600e-6, "high_precision_mm": 100e-6,
                "other": 20e-6, "reduce_scatter": 0.0}
    assert figures["categories_s"] == pytest.approx(expected)
    assert figures["shares"] == pytest.approx({k: v / 1170e-6 for k, v in expected.items()})
    # The host view of the same profile (launch times) is kept beside it, and differs.
    assert figures["host_categories_s"]["low_precision_mm"] == pytest.approx(190e-6)
    assert figures["host_shares"]["all_gather"] == pytest.approx(50 / 1000)
    assert figures["wall_s"] == pytest.approx(1000e-6)


def test_a_device_profile_without_kernels_is_labelled_host():
    from torch.profiler import ProfilerActivity, profile, record_function

    from lp_lightning.telemetry.profile_probe import STEP_LABEL, device_activity, time_shares

    assert device_activity("cpu") is None
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(STEP_LABEL):
        torch.randn(64, 64) @ torch.randn(64, 64)
    figures = time_shares(prof.events(), "npu", device_recorded=False)
    assert figures["source"] == "host" and figures["shares"] == figures["host_shares"]
    assert "torch.profiler records no npu activity here" in figures["source_reason"]
    assert time_shares(prof.events(), "cuda", device_recorded=True)["source_reason"] == (
        "no cuda kernel recorded inside the profiled steps")


def test_the_resident_probe_counts_distributions_not_generated_code(monkeypatch):
    """§17.4 "extra dependencies": installed distributions and the standard library, never torch.compile's
    code-cache modules (top-level names that are hashes), which are counted apart."""
    import types

    from lp_lightning.telemetry.resident_probe import ResidentObjectsProbe

    monkeypatch.setitem(sys.modules, "c25jtst7zsfacyijajb77jsa7kw2ya6q7egqdmo4ctkfwed", types.ModuleType("c25jt"))
    modules = ResidentObjectsProbe()._payload()["modules"]
    assert "c25jtst7zsfacyijajb77jsa7kw2ya6q7egqdmo4ctkfwed" not in modules["top_level"]
    assert modules["generated_top_level"] >= 1
    assert {"torch", "lightning", "json"} <= set(modules["top_level"])
    assert {"torch", "lightning"} <= set(modules["distributions"]) and "json" not in modules["distributions"]
