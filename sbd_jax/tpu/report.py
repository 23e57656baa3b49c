"""What a compiled program needs on a slice: per-device memory against the chip's HBM, FLOPs,
XLA's time estimate, and copies of the KV cache; as a dict, as text, and as a one-line reason
when it does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from sbd_jax import sharding
from sbd_jax.run.loading import decode_mesh
from sbd_jax.tpu import step_time
from sbd_jax.tpu.cost import cost_analysis
from sbd_jax.tpu.programs import (
  DecodeShape,
  cache_layer_copies,
  compile_decode,
  compile_train_step,
  decode_settings,
)
from sbd_jax.tpu.topology import CHIPS, PROGRAMS, parse_topology, topology_devices


def report(
  c,
  topology: str,
  step_time_s: float = 0.0,
  decode: DecodeShape | None = None,
  num_slices: int = 1,
  *,
  objective: str | None = None,
  estimate: bool = False,
  compiler_options: dict | None = None,
  **sampling: Any,
) -> dict:
  """Compile the train step of config `c` (or, given `decode`, the decode loop with the run's
  sampling settings, `sampling` overriding them) for `num_slices` slices of `topology`, and
  describe memory and FLOPs. The train step is the config's objective, or `objective` ("ntp":
  the plain next-token step of the same model, data and mesh); with `estimate`, also its time
  by XLA's cost model (`step_time`) and the throughput and MFU that implies."""
  if objective is not None and objective != c.sbd.mode:
    c = c.copy_and_resolve_references()
    c.sbd.mode = objective
  generation, topology_name = parse_topology(topology)
  devices = topology_devices(topology_name, num_slices)
  if decode is None:
    mesh = sharding.mesh_from_config(c.mesh, devices)
  else:
    mesh = decode_mesh(c, devices)
  chip = CHIPS[generation]
  chips = num_slices * math.prod(int(s) for s in topology_name.split(":")[1].split("x"))
  device_hbm = chip.hbm_bytes * chips // len(devices)
  device_flops = chip.peak_flops * chips / len(devices)
  header = {
    "program": "train" if decode is None else "decode",
    "objective": c.sbd.mode if decode is None else None,
    "topology": topology_name if num_slices == 1 else f"{num_slices} x {topology_name}",
    "devices": len(devices),
    "device_kind": devices[0].device_kind,
    "mesh": dict(mesh.shape),
    "batch_size": c.train.batch_size,
    "seq_len": c.train.seq_len,
    "loss_chunk": c.train.loss_chunk,
    "remat": c.model.remat,
    "scan_layers": bool(c.model.scan_layers),
    "hbm_per_device": device_hbm,
  }
  if decode is not None:
    settings = decode_settings(c, **sampling)
    schedule = (
      "mode", "block_size", "max_new_tokens", "lockstep", "verify", "refill", "refill_rows"
    )  # fmt: skip
    header.update(
      decode={**dataclasses.asdict(decode), **{k: getattr(settings, k) for k in schedule}}
    )
  try:
    if decode is None:
      compiled, n_params, compile_s = compile_train_step(c, devices, compiler_options)
    else:
      compiled, n_params, compile_s = compile_decode(c, devices, decode, settings)
  except jax.errors.JaxRuntimeError as e:
    if "out of memory" not in str(e).lower():
      raise
    # The TPU compiler itself refuses programs that cannot fit; keep its one-line reason.
    reason = next((line for line in str(e).splitlines() if "memory" in line.lower()), str(e))
    return {**header, "fits": False, "compiler_error": " ".join(reason.split())}
  out = {
    **header,
    "params": n_params,
    "compile_s": round(compile_s, 1),
    **measured(compiled, c, len(devices), n_params, device_hbm, device_flops, train=decode is None),
  }
  if decode is not None:
    slots = settings.cache_slots(decode.prompt_len, decode.rows)
    hlo = compiled.as_text()
    rows = decode.rows // sharding.row_shards(mesh)  # on a device
    out["cache_layer_copies"] = cache_layer_copies(hlo, slots, rows)
    out["cache_layer_copies_in_loops"] = cache_layer_copies(hlo, slots, rows, in_loops=True)
  if decode is None and estimate:
    e = step_time.estimate_train_step(c, devices, dict(mesh.shape), device_flops, compiler_options)
    out["estimate"] = estimate_fields(e, out, device_flops, chips)
  if step_time_s > 0 and decode is None:
    out["step_time_s"] = step_time_s
    at_step_time = throughput(out, step_time_s, device_flops, chips)
    out.update({f"{k}_at_step_time": v for k, v in at_step_time.items()})
  return out


def measured(
  compiled, c, num_devices: int, n_params: int, device_hbm: int, device_flops: float, train: bool
) -> dict:
  """A compiled program's bytes per device (and whether they fit), FLOPs and XLA's estimate."""
  memory = compiled.memory_analysis()
  cost = cost_analysis(compiled)
  arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
  temporaries, aliased = memory.temp_size_in_bytes, memory.alias_size_in_bytes
  total = arguments + outputs - aliased + temporaries  # donated state is counted once
  flops = float(cost.get("flops", 0.0))
  model_flops = flops
  if train:
    # XLA counts a loop body once, so with scanned layers its count covers one layer; MFU and
    # time at peak use the model's FLOPs (6 N per token plus attention, remat not counted):
    # "model" for the L tokens of a row (what an NTP step of the same rows does, the MFU
    # MaxText reports), "processed" for the tokens the step runs (2L for SBD).
    counted = step_time.model_flops(c, num_devices, n_params)
    model_flops, flops = counted["model_flops_per_device"], counted["flops_per_device"]
    xla_flops = float(cost.get("flops", 0.0))
  else:
    xla_flops = flops
  estimate_s = max(float(cost.get("optimal_seconds", 0.0)), 0.0)  # < 0: no estimate
  return {
    "bytes_per_device": {
      "arguments": arguments,
      "outputs": outputs,
      "aliased": aliased,
      "temporaries": temporaries,
      "total": total,
    },
    "fits": total <= device_hbm,
    # train: the model's FLOPs; decode: XLA's count, in which the while loop's body (one
    # forward) appears once.
    "flops_per_device": flops,
    "model_flops_per_device": model_flops,
    "xla_flops_per_device": xla_flops,
    "seconds_at_peak": flops / device_flops if device_flops else None,
    "xla_estimated_seconds": estimate_s or None,
  }


def estimate_fields(e: step_time.StepEstimate, r: dict, device_flops: float, chips: int) -> dict:
  """A step estimate's parts, with the throughput and MFU it implies for train step `r`."""
  return {
    "step_s": e.seconds,
    "xla_step_s": e.xla.seconds,
    "corrected_xla_step_s": e.corrected_xla_s,
    "splash_at_peak_s": e.attention_s,
    "xla_flops_per_device": e.xla.flops,
    "xla_bytes_per_device": e.xla.bytes_accessed,
    "compile_s": round(e.compile_s, 1),
    **throughput(r, e.seconds, device_flops, chips),
  }


def throughput(r: dict, step_s: float, device_flops: float, chips: int) -> dict:
  """Tokens per second per chip and MFU of train step `r` taking `step_s` seconds: counting the
  rows' tokens and the model FLOPs (as for an NTP step of the same rows), and counting what
  the step processes (2L tokens per row for SBD)."""
  tokens = r["batch_size"] * r["seq_len"]
  factor = r["flops_per_device"] / r["model_flops_per_device"]
  return {
    "tokens_per_s_per_chip": tokens / step_s / chips,
    "processed_tokens_per_s_per_chip": factor * tokens / step_s / chips,
    "mfu": r["model_flops_per_device"] / (step_s * device_flops),
    "processed_mfu": r["flops_per_device"] / (step_s * device_flops),
  }


def format_report(r: dict) -> str:
  gib = 2**30
  place = f"on {r['topology']} ({r['devices']} x {r['device_kind']}), mesh {r['mesh']}"
  if r["program"] == "train":
    setup = (
      f"{place}, {r['objective'].upper()} step, batch {r['batch_size']} x {r['seq_len']}"
      + ("" if r["objective"] == "ntp" else f" (input 2 x {r['seq_len']})")
      + ", "
      f"loss_chunk {r['loss_chunk']}, remat {r['remat']}, scan_layers {r.get('scan_layers', False)}"
    )
  else:
    d = r["decode"]
    schedule = ""
    if d["mode"] == "sbd" and d["rows"] > 1:
      schedule = ", lockstep" if d["lockstep"] else ", rows alone"
    if d["mode"] == "sbd" and d.get("verify"):
      schedule += ", verified"
    if d.get("refill"):
      schedule += f", a queue of {d['queue']} prompts, rows refilled {d['refill_rows']} at a time"
    setup = (
      f"{place}, {d['mode'].upper()} decode of {d['rows']} rows, prompt {d['prompt_len']} + "
      f"{d['max_new_tokens']} new tokens (block {d['block_size']}{schedule})"
    )
  if "compiler_error" in r:
    return (
      f"{PROGRAMS[r['program']]} {setup}: DOES NOT FIT; the compiler says: {r['compiler_error']}"
    )
  b = r["bytes_per_device"]
  lines = [
    f"{r['program']} of {r['params'] / 1e6:,.1f}M params {setup}; compiled in {r['compile_s']} s",
    f"per device: arguments {b['arguments'] / gib:.2f} GiB + outputs {b['outputs'] / gib:.2f} "
    f"GiB - donated {b['aliased'] / gib:.2f} GiB + temporaries {b['temporaries'] / gib:.2f} GiB "
    f"= {b['total'] / gib:.2f} GiB of {r['hbm_per_device'] / gib:.1f} GiB HBM: "
    + ("fits" if r["fits"] else "DOES NOT FIT"),
    (
      f"model FLOPs per device per step: {r['flops_per_device']:.3e}"
      f" (XLA counts {r.get('xla_flops_per_device', 0.0):.3e}, a scanned layer once)"
      if r["program"] == "train"
      else f"FLOPs per device (XLA counts a while loop's body once): {r['flops_per_device']:.3e}"
    )
    + (f" ({r['seconds_at_peak']:.3g} s at peak)" if r["seconds_at_peak"] else "")
    + (
      f"; XLA's estimate {r['xla_estimated_seconds']:.3g} s" if r["xla_estimated_seconds"] else ""
    ),
  ]
  if "cache_layer_copies" in r:
    copies, in_loops = r["cache_layer_copies"], r.get("cache_layer_copies_in_loops")
    where = "" if in_loops is None else f" ({in_loops} inside its loops, the rest once per call)"
    lines.append(f"copies of a KV-cache layer in the program: {copies}{where}")
    d = r["decode"]
    if copies and d["mode"] == "sbd" and d["rows"] > 1 and not d["lockstep"]:
      lines.append(
        "  (rows moving alone write the cache at per-row offsets, which this compiler lays out "
        "apart from attention, e.g. at a head_dim below 128: compare with --lockstep --noverify)"
      )
  if "estimate" in r:
    e = r["estimate"]
    lines.append(
      f"estimated step: {e['step_s']:.3g} s = XLA's cost model {e['xla_step_s']:.3g} s (layers "
      f"extrapolated from 1 and 2; {e['corrected_xla_step_s']:.3g} s for the matmul FLOPs it "
      f"does not count) + splash kernels at peak {e['splash_at_peak_s']:.3g} s; "
      + _throughput_line(e)
    )
  if "mfu_at_step_time" in r:
    lines.append(
      f"at a {r['step_time_s']} s step: "
      + _throughput_line({k.removesuffix("_at_step_time"): v for k, v in r.items()})
    )
  return "\n".join(lines)


def _throughput_line(t: dict) -> str:
  line = f"{t['tokens_per_s_per_chip']:,.0f} tokens/s/chip, MFU {100 * t['mfu']:.1f} %"
  if t["processed_mfu"] != t["mfu"]:
    line += (
      f" (processed tokens: {t['processed_tokens_per_s_per_chip']:,.0f}/s/chip, "
      f"MFU {100 * t['processed_mfu']:.1f} %)"
    )
  return line


def no_fit_reason(r: dict) -> str:
  if "compiler_error" in r:
    return f"the {PROGRAMS[r['program']]} does not fit on {r['device_kind']}: {r['compiler_error']}"
  need, have = r["bytes_per_device"]["total"] / 2**30, r["hbm_per_device"] / 2**30
  fixes = (
    "shorten train.seq_len, lower train.batch_size, or set model.remat / train.loss_chunk"
    if r["program"] == "train"
    else "lower --rows, --prompt_len or --max_new_tokens"
  )
  return (
    f"the {PROGRAMS[r['program']]} needs {need:.1f} GiB per device, more than the {have:.1f} GiB of HBM "
    f"of {r['device_kind']}; shard over more chips, {fixes}"
  )
