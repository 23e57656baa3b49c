"""SBD / NTP decoding: exact KV caching vs an uncached recompute, batching, EOS, NFE, sharding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_helpers import (  # tests/ is on sys.path
  BOS,
  EOS,
  MASK,
  PAD,
  PROMPTS,
  check_against_reference,
  decode_settings,
  peaky_model,
  reference_ntp,
  reference_sbd,
)
from flax import nnx

from sbd_jax import sharding
from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import compiled, memory, sampler, sampling
from sbd_jax.decode import loop as decode_loop
from sbd_jax.decode import queue as decode_queue
from sbd_jax.decode.compiled import compiled_count
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import default_tuning
from sbd_jax.model.kv_cache import KVCache


@pytest.fixture(scope="module")
def model():
  return peaky_model()


S4 = dict(block_size=4, gamma=3.0)  # the shared setting (one compilation reused by many tests)


@pytest.mark.parametrize(
  "block_size, rule, gamma, max_new",
  [
    (1, "eb_entropy", 0.35, 10),  # k = 1
    (3, "eb_entropy", 0.0, 10),  # gamma = 0, k does not divide max_new_tokens
    (4, "eb_entropy", 3.0, 10),  # several tokens per forward (S4)
    (4, "eb_confidence", 0.5, 10),
    (8, "factor", 3.0, 16),
    (8, "eb_entropy", 0.35, 5),  # max_new_tokens shorter than one block: a single block
  ],
)
def test_sbd_kv_cache_is_exact(model, block_size, rule, gamma, max_new):
  s = decode_settings(block_size=block_size, rule=rule, gamma=gamma, max_new_tokens=max_new)
  out = check_against_reference(model, s, PROMPTS, reference_sbd)
  if gamma == 0:  # one token per forward: NFE = tokens, steps 1..n within the sequence
    for toks, steps, nfe in zip(out.tokens, out.reveal_step, out.nfe):
      assert nfe == len(toks) and sorted(steps) == list(range(1, nfe + 1))
  if gamma >= 3:  # a block of P revealed in l < P forwards counts l
    assert all(nfe < len(toks) for toks, nfe in zip(out.tokens, out.nfe))


@pytest.mark.parametrize("per_forward, block_size, max_new", [(1, 4, 10), (2, 4, 10), (3, 8, 16)])
def test_forced_schedule_costs_exactly_its_count(model, per_forward, block_size, max_new):
  """The `fixed` rule reveals r tokens per forward: with no EOS a block of n open positions costs
  ceil(n / r) forwards, so NFE is known exactly whatever the model predicts."""
  s = decode_settings(
    block_size=block_size, rule="fixed", gamma=float(per_forward), max_new_tokens=max_new
  )
  out = sampler.decode(model, PROMPTS, s)
  blocks = [min(block_size, max_new - start) for start in range(0, max_new, block_size)]
  expected = sum(-(-n // per_forward) for n in blocks)
  assert not out.finished.any()
  assert list(out.nfe) == [expected] * len(PROMPTS)
  for steps in out.reveal_step:
    assert max(np.bincount(steps)) == per_forward  # r tokens per forward, never more


def test_a_decode_that_cannot_fit_fails_before_allocating(model):
  """A cache of 10^12 slots would need terabytes; the error comes first, in one line."""
  huge = decode_settings(block_size=4, max_new_tokens=10**12)
  with pytest.raises(ValueError, match=r"needs [\d.]+ GiB of KV cache and") as info:
    sampler.decode(model, PROMPTS, huge)
  assert "\n" not in str(info.value)
  cfg = sampler.SamplingModel.of(model).cfg
  per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 + 12
  assert memory.decode_bytes_per_device(cfg, rows=8, slots=100, ways=4) == 2 * 100 * per_slot


def test_a_long_prompts_prefill_is_counted_and_its_attention_chunked(model, monkeypatch):
  """A prefill longer than an attention chunk runs the chunked kernel over the cache (dense
  scores of 20 rows of an 8k-token bucket on the main job's model would be 45 GB), with the
  logits of the dense forward; the memory check counts the prefill, and refuses in one line a
  batch whose prefill does not fit."""
  cfg = sampler.SamplingModel.of(model).cfg
  assert cfg.attention_impl == "dense" and cfg.attention_chunk < 300
  graphdef, state = nnx.split(model)
  prompt_1T = np.asarray([[BOS] + [(7 * i) % 250 for i in range(299)]], np.int32)
  meta = TokenMeta.causal(np.ones_like(prompt_1T), np.arange(300, dtype=np.int32)[None])
  dense = model(prompt_1T, meta)[0]
  cached, _ = decode_loop.model_forward(
    graphdef, state, prompt_1T, meta, KVCache.empty(cfg, 1, 320), None
  )
  np.testing.assert_allclose(cached, dense, atol=2e-4, rtol=2e-4)
  main_job = cfg.replace(num_heads=4, num_kv_heads=4, attention_chunk=176)
  chunked = memory.prefill_bytes_per_device(main_job, rows=20, tokens=8196, slots=8324)
  as_dense = 2 * 20 * 4 * 8196 * 8324 * 4  # float32 scores and probabilities over every slot
  assert chunked < as_dense / 25
  s = decode_settings(block_size=16)
  slots = s.cache_slots(512, 20)  # a bucket of 512 prompt slots, then 16 + a spare block
  need = memory.decode_bytes_per_device(cfg, 20, slots)
  need += memory.prefill_bytes_per_device(cfg, 20, 512 + 16, slots)
  monkeypatch.setattr(sharding, "device_memory_bytes", lambda: 2 * need - 1)
  with pytest.raises(ValueError, match="for the prefill of 528 tokens a row") as info:
    sampler.decode(model, [prompt_1T[0].tolist()] * 20, s)
  assert "\n" not in str(info.value)


@pytest.mark.integration  # a forward count on long decodes
def test_no_forward_is_spent_past_a_revealed_eos(model):
  """γ = 0 reveals one token per forward. Once an EOS is revealed, the positions after it are
  closed: every later forward reveals a kept token (one before the EOS)."""
  s = decode_settings(block_size=8, gamma=0.0, max_new_tokens=16)
  free = sampler.decode(model, PROMPTS, s)
  wasted_before_eos = 0
  for eos in sorted({toks[j] for toks in free.tokens for j in (2, 5)}):
    out = check_against_reference(model, s.replace(eos_id=eos), PROMPTS, reference_sbd)
    for toks, steps, nfe, finished in zip(out.tokens, out.reveal_step, out.nfe, out.finished):
      if finished:
        eos_step = steps[-1]
        wasted = set(range(1, nfe + 1)) - set(steps)  # forwards that revealed a dropped token
        assert all(w < eos_step for w in wasted), (eos, toks, steps, nfe)
        wasted_before_eos += len(wasted)
  assert wasted_before_eos > 0  # the case is exercised: tokens past the end revealed early


def test_ntp_kv_cache_is_exact(model):
  check_against_reference(model, decode_settings(mode="ntp"), PROMPTS, reference_ntp)


def test_batch_equals_alone(model):
  s = decode_settings(**S4)
  batch = sampler.decode(model, PROMPTS, s)
  for i, prompt in enumerate(PROMPTS):
    alone = sampler.decode(model, [prompt], s)
    assert alone.tokens[0] == batch.tokens[i]
    assert alone.reveal_step[0] == batch.reveal_step[i]
    assert alone.nfe[0] == batch.nfe[i]
    assert alone.batch_forwards[0] == alone.nfe[0]  # every forward of a lone row serves it
  # Rows move through their blocks alone: the batch runs exactly its slowest row's NFE.
  assert (batch.batch_forwards == batch.nfe.max()).all()
  # Batches of 2 (the last padded with an inactive row) give the same result too.
  chunked = sampler.decode(model, PROMPTS, s, batch_size=2, min_bucket=32)
  assert chunked.tokens == batch.tokens and (chunked.nfe == batch.nfe).all()
  assert chunked.batch_forwards[2] == chunked.nfe[2]  # the last batch's only active row
  # NTP: the longest prompt alone (another bucket) equals its row of the batch.
  ntp = decode_settings(mode="ntp")
  ntp_batch = sampler.decode(model, PROMPTS, ntp)
  assert sampler.decode(model, [PROMPTS[0]], ntp).tokens[0] == ntp_batch.tokens[0]
  # NTP rows never wait for each other: the batch runs exactly its slowest row's forwards.
  assert (ntp_batch.batch_forwards == ntp_batch.nfe.max()).all()


@pytest.mark.parametrize(
  "rule, gamma, block_size, max_new", [("eb_entropy", 0.35, 4, 13), ("eb_confidence", 1.0, 8, 16)]
)
def test_rows_move_through_blocks_alone(model, rule, gamma, block_size, max_new):
  """A row starts its next block as soon as its own is complete, so the batch runs exactly
  its slowest row's NFE; in lockstep it waits at every block for its slowest row and runs
  more. Either way each row decodes as it would alone (lockstep checked against the uncached
  reference here, rows moving alone in test_sbd_kv_cache_is_exact)."""
  s = decode_settings(block_size=block_size, rule=rule, gamma=gamma, max_new_tokens=max_new)
  prompts = PROMPTS + [[BOS, 5, 6, 7, 8], [BOS] + list(range(100, 110)), [BOS, 200]]
  alone = sampler.decode(model, prompts, s)
  lockstep = check_against_reference(model, s.replace(lockstep=True), prompts, reference_sbd)
  assert alone.tokens == lockstep.tokens and alone.reveal_step == lockstep.reveal_step
  assert (alone.nfe == lockstep.nfe).all()
  assert (alone.batch_forwards == alone.nfe.max()).all()
  assert lockstep.batch_forwards[0] > alone.batch_forwards[0]  # the rows' paces differ here
  # A 2P-token forward starts each block after the first: in lockstep once per block of the
  # longest row; alone whenever some row starts one.
  blocks = [-(-len(toks) // block_size) for toks in alone.tokens]
  assert lockstep.batch_wide_forwards[0] == max(blocks) - 1
  assert max(blocks) - 1 <= alone.batch_wide_forwards[0] <= sum(n - 1 for n in blocks)
  assert alone.batch_wide_forwards[0] > max(blocks) - 1  # rows started blocks at different times


QUEUED = PROMPTS + [[BOS, 5, 6, 7, 8], [BOS] + list(range(100, 110)), [BOS, 200], [BOS, 77, 78]]


@pytest.mark.parametrize(
  "mode, block_size, gamma, max_new",
  [
    ("sbd", 4, 0.35, 13),
    pytest.param("sbd", 4, 3.0, 4, marks=pytest.mark.integration),  # a single SBD block
    pytest.param("ntp", 4, 0.0, 13, marks=pytest.mark.integration),
  ],
)
def test_refill_decodes_every_prompt_as_alone(model, mode, block_size, gamma, max_new):
  """A queue of 7 prompts through 1 and 3 rows, finished rows taking the next prompts one or
  two at a time: each prompt decodes exactly as the uncached reference does alone, and with
  one at a time no row idles while a prompt waits. EOS is a token the model emits, so rows
  finish at different times."""
  s = decode_settings(mode=mode, block_size=block_size, gamma=gamma, max_new_tokens=max_new)
  eos = sampler.decode(model, PROMPTS, s).tokens[0][2]
  s = s.replace(eos_id=eos, refill=True)
  reference = reference_sbd if mode == "sbd" else reference_ntp
  expected = [reference(model, prompt, s) for prompt in QUEUED]
  assert 0 < sum(toks[-1] == eos for toks, _, _ in expected) < len(QUEUED)
  for rows, together in ((1, 1), (3, 1), (3, 2)):
    out = sampler.decode(model, QUEUED, s.replace(refill_rows=together), batch_size=rows)
    assert out.tokens == [toks for toks, _, _ in expected], rows
    assert out.reveal_step == [steps for _, steps, _ in expected], rows
    assert list(out.nfe) == [nfe for _, _, nfe in expected], rows
    # Rows are refilled `together` at a time, in one prefill forward each time.
    assert -(-len(QUEUED) // together) <= out.prefills <= len(QUEUED)
    # No row-forward is charged twice, and each prompt is charged at least its NFE.
    assert (out.batch_forwards >= out.nfe).all()
    assert out.batch_forwards.sum() <= rows * (out.forwards - out.prefills) + len(QUEUED)
    if together == 1:  # rows never wait: only a row's last prompt is charged past its NFE
      assert np.sum(out.batch_forwards > out.nfe) <= rows


def test_refill_compiles_once_per_queue_bucket(model):
  """The count of queued prompts is traced: 5 and 7 prompts (a queue of 8 slots) share one
  compilation."""
  s = decode_settings(block_size=4, gamma=0.5, max_new_tokens=9, refill=True)
  before = compiled_count()
  sampler.decode(model, QUEUED[:5], s, batch_size=2)
  sampler.decode(model, QUEUED[:7], s, batch_size=2)
  assert compiled_count() == before + 1


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize(
  "mode, together", [pytest.param("sbd", 2, marks=pytest.mark.integration), ("ntp", 1)]
)
def test_sharded_refill_equals_single_device(model, mode, together):
  """Refill over 8 devices: one queue, 4 rows split over (data, fsdp) and the weights over
  tensor; rows finish at different times (an EOS the model emits) and are refilled `together`
  at a time (a scatter of two rows, or a select of one: `queue.put_rows`). Tokens,
  reveal steps, NFE and every count of forwards are those of one device."""
  s = decode_settings(mode=mode, block_size=4, gamma=0.5, max_new_tokens=9)
  eos = sampler.decode(model, PROMPTS, s).tokens[0][2]
  s = s.replace(eos_id=eos, refill=True, refill_rows=together)
  single = sampler.decode(model, QUEUED, s, batch_size=4)
  assert 0 < sum(toks[-1] == eos for toks in single.tokens) < len(QUEUED)
  sharded = sampler.decode(model, QUEUED, s, batch_size=4, mesh=sharding.make_mesh((2, 2, 2)))
  assert sharded.tokens == single.tokens
  assert sharded.reveal_step == single.reveal_step
  assert (sharded.nfe == single.nfe).all()
  assert (sharded.batch_forwards == single.batch_forwards).all()
  assert (sharded.forwards, sharded.prefills) == (single.forwards, single.prefills)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sbd", "ntp"])
def test_a_prompts_samples_do_not_depend_on_its_batch(model, mode):
  """Sampling (temperature > 0): prompt i draws from fold_in(key(seed), i), so the same
  prompts and seed give every prompt the same tokens in one batch, in batches of 3, and
  through 3 rows refilled two at a time; another seed gives other tokens."""
  s = decode_settings(mode=mode, block_size=4, gamma=0.5, max_new_tokens=9, temperature=2.0)
  whole = sampler.decode(model, QUEUED, s, seed=1)
  assert all(MASK not in toks for toks in whole.tokens)
  assert sampler.decode(model, QUEUED, s, seed=1, batch_size=3).tokens == whole.tokens
  refill = s.replace(refill=True, refill_rows=2)
  assert sampler.decode(model, QUEUED, refill, seed=1, batch_size=3).tokens == whole.tokens
  assert sampler.decode(model, QUEUED, s, seed=2).tokens != whole.tokens


@pytest.mark.parametrize(
  "lockstep, mesh_shape",
  [
    (False, None),
    *(pytest.param(*p, marks=pytest.mark.integration) for p in [(True, None), (False, (2, 2, 2))]),
  ],
)
def test_the_tpu_cache_layout_decodes_the_same_tokens(model, monkeypatch, lockstep, mesh_shape):
  """The decode compiled for TPU stores its cache heads-first; run here on the CPU, it gives
  the tokens, reveal steps and NFE of the CPU's slots-first cache: rows alone and in lockstep,
  and sharded over 8 devices (the heads-first cache split by rows and KV heads)."""
  if mesh_shape and jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  s = decode_settings(block_size=4, max_new_tokens=13, lockstep=lockstep, gamma=0.5)
  prompts = PROMPTS + [[BOS, 5, 6, 7, 8]]
  mesh = sharding.make_mesh(mesh_shape) if mesh_shape else None
  slots_first = sampler.decode(model, prompts, s)
  traced = compiled.compiled_count()
  monkeypatch.setattr(decode_loop, "platform", lambda mesh: "tpu")
  compiled.decode_batch.clear_cache()  # retrace with the TPU layout
  heads_first = sampler.decode(model, prompts, s, mesh=mesh)
  compiled.decode_batch.clear_cache()  # later tests trace the CPU layout again
  assert compiled.compiled_count() == traced + 1
  assert heads_first.tokens == slots_first.tokens
  assert heads_first.reveal_step == slots_first.reveal_step
  assert (heads_first.nfe == slots_first.nfe).all()
  assert (heads_first.batch_forwards == slots_first.batch_forwards).all()


@pytest.mark.parametrize("mode", ["sbd", "ntp"])
def test_eos_stops_each_sequence(model, mode):
  """Make a token the model emits the EOS: each sequence ends at an EOS and keeps it. Every token
  revealed up to the forward that revealed the EOS is unchanged; a masked position before the
  EOS is decoded afterwards with the positions past the EOS closed (filled with EOS), so under
  SBD it may differ. NTP stops exactly at the first occurrence."""
  s = decode_settings(mode=mode, **S4)
  free = sampler.decode(model, PROMPTS, s)
  assert not free.finished.any()
  eos = free.tokens[0][5]
  stopped = sampler.decode(model, PROMPTS, s.replace(eos_id=eos))
  for i in range(len(PROMPTS)):
    toks, steps, got = free.tokens[i], free.reveal_step[i], stopped.tokens[i]
    if eos not in toks:
      assert got == toks and stopped.nfe[i] == free.nfe[i]
      continue
    j = toks.index(eos)
    assert stopped.finished[i] and got[-1] == eos and eos not in got[:-1]
    assert len(got) <= j + 1
    for k in range(len(got)):
      if steps[k] <= steps[j]:
        assert got[k] == toks[k], (i, k)
    if mode == "ntp":
      assert got == toks[: j + 1] and stopped.nfe[i] == j + 1
    assert stopped.nfe[i] <= free.nfe[i]
  assert stopped.finished[0]


def test_no_recompilation_within_a_bucket(model):
  s = decode_settings(block_size=4, gamma=1.0, max_new_tokens=7)  # settings no other test uses
  before = compiled_count()
  sampler.decode(model, [[BOS, 1, 2, 3], [BOS] + list(range(10, 20))], s)
  assert compiled_count() == before + 1
  sampler.decode(model, [[BOS] * 12, [BOS, 5]], s)  # other prompts and lengths, same bucket
  sampler.decode(model, [[BOS, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [BOS]], s)
  assert compiled_count() == before + 1


def test_a_gamma_sweep_compiles_once(model):
  """γ is a traced value: every γ of a sweep reuses one compilation, and still acts."""
  before = compiled_count()
  outs = []
  for gamma in (0.0, 0.5, 3.0, 100.0):
    s = decode_settings(block_size=8, rule="eb_confidence", gamma=gamma, max_new_tokens=11)
    outs.append(sampler.decode(model, PROMPTS, s))
  assert compiled_count() == before + 1
  assert not any(out.finished.any() for out in outs)  # no EOS: NFE depends on γ alone
  assert list(outs[0].nfe) == [11] * len(PROMPTS)  # γ = 0: one token per forward
  assert list(outs[-1].nfe) == [2] * len(PROMPTS)  # γ = 100: a whole block per forward


@pytest.mark.integration
def test_mask_token_never_emitted(model):
  """Make the mask id the model's favourite token; it never appears, greedy or sampled."""
  free = sampler.decode(model, PROMPTS, decode_settings(**S4))
  favourite = max(range(256), key=lambda t: sum(toks.count(t) for toks in free.tokens))
  assert sum(toks.count(favourite) for toks in free.tokens) >= 3
  for mode, temperature in (("sbd", 0.0), ("sbd", 3.0), ("ntp", 3.0)):
    s = SamplerSettings(
      eos_id=EOS,
      mask_id=favourite,
      pad_id=PAD,
      mode=mode,
      temperature=temperature,
      max_new_tokens=10,
      **S4,
    )
    out = sampler.decode(model, PROMPTS, s, seed=1)
    assert all(favourite not in toks and len(toks) == 10 for toks in out.tokens)
    if temperature > 0:  # sampling is driven by the explicit seed
      assert sampler.decode(model, PROMPTS, s, seed=1).tokens == out.tokens
      assert sampler.decode(model, PROMPTS, s, seed=2).tokens != out.tokens


def test_greedy_pick_is_numpy_argmax_with_ties_and_infinities():
  """The greedy pick (max, then the first index holding it) equals np.argmax: the first of
  tied maxima, -inf rows and ±inf entries included."""
  rng = np.random.default_rng(0)
  logits = rng.integers(-3, 4, (5, 7, 33)).astype(np.float32)  # many ties
  logits[0, 0] = -np.inf
  logits[1, 2, [4, 9]] = np.inf
  logits[2, 3, :5] = -np.inf
  got = np.asarray(sampling.argmax(jnp.asarray(logits)))
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


@pytest.mark.parametrize(
  "mode, lockstep, temperature",
  [("sbd", False, 0.0), ("sbd", True, 0.0), ("ntp", False, 0.0), ("sbd", False, 1.0)],
)
def test_the_compiled_decode_never_copies_the_kv_cache(model, mode, lockstep, temperature):
  """A forward updates the cache in place: no copy of a cache layer in the whole program (a
  `lax.cond` between SBD's first and later passes cost two per forward, into the branch and out
  of it; sampling's, between drawing and the argmax, holds no cache). Rows moving alone write at
  per-row offsets: a scatter, in place too."""
  s = decode_settings(
    mode=mode, block_size=4, max_new_tokens=13, lockstep=lockstep, temperature=temperature
  )  # both passes
  sm = sampler.SamplingModel.of(model)
  rows, bucket = len(PROMPTS), sampler.prompt_bucket(max(len(p) for p in PROMPTS))
  cache_length = s.cache_slots(bucket, rows)
  args = (
    np.zeros((rows, bucket), np.int32),
    np.ones((rows,), np.int32),
    np.ones((rows,), bool),
    np.uint32(0),
    np.int32(0),
    np.float32(s.gamma),
    np.float32(temperature),
    default_tuning(s),
    np.int32(s.max_new_tokens),
  )
  hlo = compiled.decode_batch.lower(
    sm.static_graph, sm.weights, *args,
    settings=s, model_cfg=sm.cfg, cache_length=cache_length, mesh=None,
  ).compile().as_text()  # fmt: skip
  cfg = sm.cfg
  layer = f"f32[{rows},{cache_length},{cfg.num_kv_heads},{cfg.head_dim}]"
  assert hlo.count(layer) > 0  # the cache is there, under the name looked for
  copies = [line for line in hlo.splitlines() if f"= {layer}" in line and " copy(" in line]
  assert not copies, f"{len(copies)} copies of a cache layer, e.g. {copies[0].strip()[:120]}"


@pytest.mark.parametrize("mode, together", [("sbd", 2), ("ntp", 1)])
def test_the_refill_loop_never_copies_the_kv_cache(model, mode, together):
  """Refilled rows are scattered into the batch's cache in place: the only copies of a cache
  layer are of its zero initialisation (one buffer per layer), made once per call."""
  s = decode_settings(mode=mode, block_size=4, max_new_tokens=13, refill=True, refill_rows=together)
  sm = sampler.SamplingModel.of(model)
  rows, bucket, queue = 3, 32, 8
  cache_length = s.cache_slots(bucket, rows)
  hlo = decode_queue.decode_queue.lower(
    sm.static_graph, sm.weights, np.zeros((queue, bucket), np.int32), np.ones((queue,), np.int32),
    np.int32(5), np.uint32(0), np.float32(s.gamma), np.float32(0.0), default_tuning(s),
    np.int32(s.max_new_tokens), rows=rows, settings=s, model_cfg=sm.cfg, cache_length=cache_length,
  ).compile().as_text()  # fmt: skip
  layer = f"f32[{rows},{cache_length},{sm.cfg.num_kv_heads},{sm.cfg.head_dim}]"
  assert hlo.count(layer) > 0
  copies = [line for line in hlo.splitlines() if f"= {layer}" in line and " copy(" in line]
  assert len(copies) <= 2 * sm.cfg.num_layers
  assert all(re.search(r" copy\(%wrapped_broadcast[.\d]*\)", line) for line in copies), copies


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("mode", ["sbd", "ntp"])
def test_sharded_equals_single_device(model, mode):
  s = decode_settings(mode=mode, **S4)
  single = sampler.decode(model, PROMPTS, s)
  sharded = sampler.decode(model, PROMPTS, s, mesh=sharding.make_mesh((2, 2, 2)))
  assert sharded.tokens == single.tokens
  assert sharded.reveal_step == single.reveal_step
  assert (sharded.nfe == single.nfe).all()


def test_a_repeated_decode_does_not_rehash_the_graph(model, monkeypatch):
  """jit hashes static arguments on every call; the graphdef's hash is computed once per
  SamplingModel (an 8B GraphDef hashes node by node, about a millisecond of host time)."""
  sm = sampler.SamplingModel.of(model)
  s = decode_settings(block_size=4, max_new_tokens=5)
  first = sampler.decode(sm, PROMPTS, s, seed=3)
  graphdef_type = type(sm.graphdef)
  hashes = [0]
  original = graphdef_type.__hash__

  def counting_hash(self):
    hashes[0] += 1
    return original(self)

  monkeypatch.setattr(graphdef_type, "__hash__", counting_hash)
  again = sampler.decode(sm, PROMPTS, s, seed=3)
  assert hashes[0] == 0
  assert again.tokens == first.tokens
  with pytest.raises(ValueError, match="seed"):
    sampler.decode(sm, PROMPTS, s, seed=-1)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(gamma=-0.1), "gamma must be >= 0"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(rule="greedy"), "unknown reveal rule"),
    (dict(mode="beam"), "unknown decode mode"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(lockstep="yes"), "lockstep must be True or False"),
    (dict(refill=True, lockstep=True), "refill needs rows that move alone"),
    (dict(refill=True, refill_rows=0), "refill_rows must be >= 1"),
    (dict(refill_rows=4), "refill_rows=4 applies to refill"),
  ],
)
def test_bad_settings(change, message):
  with pytest.raises(ValueError, match=message):
    decode_settings(**change)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sbd", "ntp"])
def test_a_longer_cache_decodes_the_same_tokens(model, mode):
  """`cache_length` sets the cache's length (benchmarks time decodes of different lengths over
  one cache): the slots past what a decode needs are seen by nothing."""
  s = decode_settings(mode=mode, block_size=4, max_new_tokens=12)
  plain = sampler.decode(model, PROMPTS, s, batch_size=2)
  needed = s.cache_slots(sampler.prompt_bucket(17), 2)
  longer = sampler.decode(model, PROMPTS, s, batch_size=2, cache_length=needed + 40)
  for got, want in zip(longer.tokens, plain.tokens):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(longer.nfe, plain.nfe)
  np.testing.assert_array_equal(longer.batch_forwards, plain.batch_forwards)


def test_bad_inputs(model):
  s = decode_settings(block_size=4)
  with pytest.raises(ValueError, match="empty"):
    sampler.decode(model, [[BOS], []], s)
  with pytest.raises(ValueError, match="cache_length"):
    sampler.decode(model, [[BOS] * 20], s.replace(max_new_tokens=100), cache_length=64)
  with pytest.raises(ValueError, match="outside"):
    sampler.decode(model, [[BOS, 999]], s)
