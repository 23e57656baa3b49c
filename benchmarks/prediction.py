"""What the paper's formula and the decodes' own forward counts predict for SBD's wall-clock
speedup over NTP, from measured forward times time(n) (the paper's section 4)."""

from __future__ import annotations

import numpy as np


def paper_speedup(times: dict[int, float], block_size: int, forwards_per_block: float) -> float:
  """speedup(l, k) = k time(1) / (time(2k) + (l - 1) time(k)), with measured time(n)."""
  k, l = block_size, forwards_per_block
  return k * times[1] / (times[2 * k] + (l - 1) * times[k])


def accounted_speedup(
  times: dict[int, float],
  block_size: int,
  ntp_nfe: np.ndarray,
  sbd_nfe: np.ndarray,
  sbd_lengths: np.ndarray,
  prefill: tuple[float, float] | None = None,
  call: tuple[float, float] = (0.0, 0.0),
  sbd_wide: np.ndarray | None = None,
  sbd_ntp: np.ndarray | None = None,
  sbd_kinds: np.ndarray | None = None,
  widths: tuple[int, ...] = (),
) -> float:
  """Predicted wall-clock speedup from the decodes' own counts: per sample, NTP costs nfe time(1);
  SBD costs one time(2k) per block (its first pass) plus time(k) per other forward. Summed over
  samples. `sbd_wide`, if given, is each sample's count of 2k-token forwards after the first
  forward (the decode's `batch_wide_forwards`; a batch whose rows move alone runs one whenever
  some row starts a block), in place of one per block after the first. Without `prefill` the
  prompt's forward is left out of both. With `prefill` = (NTP's prompt forward, SBD's
  prompt-plus-first-block forward), in seconds per batch, each decode's first forward is
  charged at that time instead (as the decode loop runs it). `call` = (NTP's, SBD's) cost of a
  decode call beyond its forwards, charged once per decode. `sbd_ntp`, if given, counts each
  sample's one-token forwards (verified SBD's NTP forwards), charged at time(1). `sbd_kinds`
  [samples, K], if given, counts each sample's forwards by kind (`DecodeOutput.batch_kind_forwards`:
  NTP's, then a wide forward of each of `widths`, charged at time(1) and time(2D)) in place of
  `sbd_wide` and `sbd_ntp`."""
  k = block_size
  ntp_nfe, sbd_nfe = np.asarray(ntp_nfe), np.asarray(sbd_nfe)
  blocks = np.maximum(np.ceil(np.asarray(sbd_lengths) / k), 1)
  wide = blocks - 1 if sbd_wide is None else np.asarray(sbd_wide)
  one = np.zeros_like(wide) if sbd_ntp is None else np.asarray(sbd_ntp)
  if sbd_kinds is None:
    kinds = wide * times[2 * k] + one * times[1]
    counted = wide + one
  else:
    kind_times = np.asarray([times[1]] + [times[2 * d] for d in widths])
    kinds, counted = np.asarray(sbd_kinds) @ kind_times, np.asarray(sbd_kinds).sum(axis=1)
  later = sbd_nfe - 1 - counted  # k-token forwards
  if prefill is None:
    ntp = np.sum(ntp_nfe) * times[1]
    sbd = np.sum(times[2 * k] + kinds + later * times[k])
  else:  # like every other forward, the batch's prefill is charged to each sample
    ntp = np.sum(prefill[0] + (ntp_nfe - 1) * times[1])
    sbd = np.sum(prefill[1] + kinds + later * times[k])
  ntp, sbd = ntp + len(ntp_nfe) * call[0], sbd + len(sbd_nfe) * call[1]
  return float(ntp / sbd)


def forwards_per_block(nfe: np.ndarray, lengths: np.ndarray, block_size: int) -> float:
  """Mean over samples of forwards per block touched (l of the paper)."""
  blocks = np.maximum(np.ceil(np.asarray(lengths) / block_size), 1)
  return float(np.mean(np.asarray(nfe) / blocks))
