"""Shared by the decoding tests: a tiny model with peaky predictions, decode settings over its
token ids, and uncached references (every forward recomputed from scratch with the paper's
Figure 10 mask) of NTP, SBD and verified SBD."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.model.architectures import tiny
from sbd_jax.model.transformer import Transformer
from sbd_jax.sbd import reveal_rules

PAD, BOS, EOS, MASK = 256, 257, 258, 259
PROMPTS = [[BOS, 72, 105], [BOS] + list(range(40, 48)), [BOS] + list(range(60, 76))]  # 3, 9, 17


def peaky_model(seed: int = 0, dtype: str = "float32") -> Transformer:
  """A tiny model (fp32, or `dtype`) with peaky, position-dependent predictions (random ones
  are ~uniform)."""
  cfg = tiny(
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    attention_impl="dense",
    tie_embeddings=False,
    param_dtype=dtype,
    compute_dtype=dtype,
  )
  model = nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))()  # jitted: fast init
  model.lm_head_DV[...] = model.lm_head_DV[...] * 50
  for block in model.blocks:
    for p in (block.attention.q_DNH, block.attention.k_DKH):
      p[...] = p[...] * 10
  return model


def decode_settings(**kw) -> SamplerSettings:
  """Settings over the tokens above: plain SBD (unverified) unless `verify` is given."""
  kw.setdefault("max_new_tokens", 10)
  kw.setdefault("verify", False)
  return SamplerSettings(eos_id=EOS, mask_id=MASK, pad_id=PAD, **kw)


def masked_logp(logits):
  return jax.nn.log_softmax(logits.astype(jnp.float32).at[..., MASK].set(-jnp.inf), axis=-1)


REF_LEN = 48  # the uncached reference pads every sequence on the right to this many slots


@functools.partial(jax.jit, static_argnums=0)
def _uncached_logits(graphdef, state, tokens_1T, meta):
  return nnx.merge(graphdef, state)(tokens_1T, meta)[0]


def recompute(model, tokens, num_clean):
  """Logits [1, n, V] of one uncached forward over `tokens`: `num_clean` causal tokens, then
  block tokens (Figure 10 mask). Right padding (segment 0) keeps one compiled shape."""
  n = len(tokens)
  pad = REF_LEN - n
  meta = TokenMeta(
    segment_ids=np.asarray([[1] * n + [0] * pad], np.int32),
    positions=np.arange(REF_LEN, dtype=np.int32)[None],
    is_block=(np.arange(REF_LEN) >= num_clean)[None] & (np.arange(REF_LEN) < n),
    block_start=np.full((1, REF_LEN), num_clean, np.int32),
  )
  graphdef, state = nnx.split(model)
  logits = _uncached_logits(graphdef, state, np.asarray([tokens + [PAD] * pad], np.int32), meta)
  return logits[:, :n]


def reference_sbd(model, prompt, s):
  """Uncached greedy SBD: every forward recomputes [prompt + generated ; block] from scratch
  with the Figure 10 mask. Returns (tokens incl. EOS, reveal steps, NFE)."""
  rule = reveal_rules.get_rule(s.rule)
  p = s.block_size
  gen, steps, nfe = [], [], 0
  while len(gen) < s.max_new_tokens:
    ctx = prompt + gen
    n = len(ctx)
    valid = [len(gen) + i < s.max_new_tokens for i in range(p)]
    block, block_steps = [MASK] * p, [0] * p
    while True:
      open_ = [block[i] == MASK and valid[i] for i in range(p)]
      if not any(open_):
        break
      logp = masked_logp(recompute(model, ctx + block, num_clean=n)[:, n:])
      reveal = np.asarray(rule(logp, jnp.asarray([open_]), s.gamma))[0]
      sampled = np.asarray(jnp.argmax(logp, -1))[0]
      if s.settle_eos:
        reveal = settle_eos_reference(reveal, open_, sampled, s.eos_id)
      nfe += 1
      for i in np.flatnonzero(reveal):
        block[i], block_steps[i] = int(sampled[i]), nfe
      eos = [i for i in range(p) if valid[i] and block[i] == s.eos_id]
      if eos:  # positions after the first EOS are closed and hold EOS
        block[eos[0] + 1 :] = [s.eos_id] * (p - eos[0] - 1)
        if all(block[j] != MASK for j in range(eos[0])):
          return gen + block[: eos[0] + 1], steps + block_steps[: eos[0] + 1], nfe
    kept = sum(valid)
    gen, steps = gen + block[:kept], steps + block_steps[:kept]
  return gen, steps, nfe


def settle_eos_reference(reveal, open_, sampled, eos_id):
  """The rule's reveals, plus: when the rule reveals an EOS at q, walk left from q over open
  positions that predict EOS, and reveal the last one reached."""
  reveal = np.array(reveal)
  revealed_eos = [i for i in np.flatnonzero(reveal) if sampled[i] == eos_id]
  if revealed_eos:
    j = min(revealed_eos)
    while j > 0 and open_[j - 1] and sampled[j - 1] == eos_id:
      j -= 1
    reveal[j] = True
  return reveal


def reference_ntp(model, prompt, s):
  """Uncached greedy NTP: recompute the whole causal sequence for every token."""
  gen = []
  while len(gen) < s.max_new_tokens:
    tokens = prompt + gen
    logits = recompute(model, tokens, num_clean=len(tokens))[:, -1]
    gen.append(int(jnp.argmax(masked_logp(logits), -1)[0]))
    if gen[-1] == s.eos_id:
      break
  return gen, list(range(1, len(gen) + 1)), len(gen)


def check_against_reference(model, s, prompts, reference):
  out = sampler.decode(model, prompts, s)
  for i, prompt in enumerate(prompts):
    tokens, steps, nfe = reference(model, prompt, s)
    assert out.tokens[i] == tokens, f"prompt {i}"
    assert out.reveal_step[i] == steps, f"prompt {i}"
    assert out.nfe[i] == nfe, f"prompt {i}"
    assert MASK not in out.tokens[i]
    if not out.finished[i]:  # every counted forward revealed a kept token: NFE = distinct steps
      assert nfe == len(set(steps)) == max(steps)
  return out


def _choose(logits_1TV, s, key_slots):
  """Tokens [T] from logits [1, T, V] as the sampler draws them: argmax, or with a
  temperature the Gumbel-max draw fixed by (the row's key, the slot) in `key_slots`."""
  is_mask = jnp.arange(logits_1TV.shape[-1]) == MASK
  logits = jnp.where(is_mask, -jnp.inf, logits_1TV[0].astype(jnp.float32))
  if s.temperature == 0:
    return [int(t) for t in jnp.argmax(logits, -1)]
  key, slots = key_slots
  return [
    int(jax.random.categorical(jax.random.fold_in(key, slot), logits[i] / s.temperature))
    for i, slot in enumerate(slots)
  ]


def reference_verified(model, prompt, s, key=None, width=None):
  """Uncached verified SBD, as `s.check_every_forward` checks: (tokens incl. EOS, reveal steps,
  NFE, rollbacks). `width`: every forward drafts a block of that many positions."""
  if s.check_every_forward:
    return reference_checked_every_forward(model, prompt, s, key, width)
  return reference_checked_by_block(model, prompt, s, key)


def reference_checked_every_forward(model, prompt, s, key=None, width=None):
  """Uncached verified SBD checked at every forward: each forward recomputes [prompt + verified
  tokens + the run of drafts after them (causal) ; the P slots after the run (block)] from
  scratch. NTP's choices from the causal logits settle the run's drafts, kept up to the first
  that differs, which is corrected (later drafts discarded, this forward's block unused);
  else the block's first slot gets NTP's choice, and the rule (`s.draft`: or every masked
  position) reveals drafts in the block. With `width` D, every forward's block is D slots and
  its run at most D tokens (the verified one and the drafts after it; drafts past them are
  dropped first).
  `key`: the row's sampling key (temperature > 0). Returns (tokens incl. EOS, reveal steps,
  NFE, rollbacks)."""
  rule = reveal_rules.get_rule(s.rule)
  limit, q = s.max_new_tokens, len(prompt)
  tokens, steps = {}, {}  # slot -> token (verified or drafted) and the forward that set it
  verified = nfe = rollbacks = 0

  def finished():
    text = [tokens[i] for i in range(verified)]
    return text, [steps[i] for i in range(verified)], nfe, rollbacks

  while True:
    p = width if width and nfe > 0 else s.block_size  # the first forward is the prefill's
    start = verified  # the run of drafts after the verified tokens ends at a mask, EOS or limit
    while start in tokens and start < limit and (start == 0 or tokens[start - 1] != s.eos_id):
      start += 1
    if nfe > 0 and start - (verified - 1) > p:  # the run a forward of width p checks
      tokens = {i: t for i, t in tokens.items() if not verified - 1 + p <= i < start}
      start = verified - 1 + p
    ctx = prompt + [tokens[i] for i in range(start)]
    block = [tokens.get(start + j, MASK) for j in range(p)]
    logits = recompute(model, ctx + block, num_clean=len(ctx))
    nfe += 1
    slots = range(verified, start + 1)  # NTP's choices, from the logits at the slot before each
    ntp = _choose(logits[:, q + verified - 1 : q + start], s, (key, slots))
    stale = False
    for slot, choice in zip(slots, ntp):
      if slot >= limit or (slot > 0 and tokens[slot - 1] == s.eos_id):
        break  # the run ended the answer
      if slot < start and tokens[slot] == choice:  # a draft NTP accepts
        verified = slot + 1
        continue
      if slot < start:  # a draft NTP rejects: its correction, and nothing after it
        tokens = {i: t for i, t in tokens.items() if i < slot}
        rollbacks, stale = rollbacks + 1, True
      tokens[slot], steps[slot], verified = choice, nfe, slot + 1
      break
    text = [tokens[i] for i in range(verified)]
    if text and (text[-1] == s.eos_id or verified >= limit):
      return finished()
    if stale:
      continue
    block = [tokens.get(start + j, MASK) for j in range(p)]
    known_eos = min([j for j in range(p) if block[j] == s.eos_id and start + j < limit] + [p])
    open_ = [block[j] == MASK and start + j < limit and j < known_eos for j in range(p)]
    if any(open_):
      logp = masked_logp(logits[:, len(ctx) :] / (s.temperature or 1.0))
      reveal = np.asarray(rule(logp, jnp.asarray([open_]), s.gamma))[0]
      if s.draft != "rule":
        reveal = np.asarray(open_) & (s.draft == "all")
      sampled = _choose(logits[:, len(ctx) :], s, (key, range(start, start + p)))
      if s.settle_eos:
        reveal = settle_eos_reference(reveal, open_, sampled, s.eos_id)
      for j in np.flatnonzero(reveal):
        tokens[start + j], steps[start + j] = sampled[j], nfe
    block = [tokens.get(start + j, MASK) for j in range(p)]
    eos = [j for j in range(p) if block[j] == s.eos_id and start + j < limit]
    for j in range(eos[0] + 1 if eos else p, p):  # positions past the answer hold EOS
      tokens[start + j] = s.eos_id


def reference_checked_by_block(model, prompt, s, key=None):
  """Uncached verified SBD checked by blocks: every forward recomputes [prompt + verified + draft
  (causal) ; block] from scratch. A block's first forward checks the draft against NTP's choices at
  the causal positions (the draft's first token is NTP's own, set when its block began) and keeps
  NTP's token at the first disagreement, discarding the block; else it sets NTP's next token at the
  block's first position. `key`: the row's sampling key (temperature > 0).
  Returns (tokens incl. EOS, reveal steps, NFE, rollbacks)."""
  rule = reveal_rules.get_rule(s.rule)
  p, limit = s.block_size, s.max_new_tokens
  text, steps = [], []  # verified tokens
  draft, draft_steps = [], []  # the previous block, unchecked (its first token excepted)
  block, block_steps, first_pass = [MASK] * p, [0] * p, True
  nfe = rollbacks = 0
  while True:
    ctx = prompt + text + draft
    n = len(ctx)
    logits = recompute(model, ctx + block, num_clean=n)
    nfe += 1
    if first_pass:
      # NTP's choice for position i + 1 from the logits at i, for the draft's positions.
      slots = range(len(text), len(text) + len(draft) + 1)
      ntp = _choose(logits[:, n - len(draft) - 1 : n], s, (key, slots))
      wrong = [i for i in range(1, len(draft)) if draft[i] != ntp[i]]
      if wrong:
        i = wrong[0]
        text, steps = text + draft[:i] + [ntp[i]], steps + draft_steps[:i] + [nfe]
        draft, draft_steps, rollbacks = [], [], rollbacks + 1
        if text[-1] == s.eos_id or len(text) >= limit:
          return text, steps, nfe, rollbacks
        continue  # this forward's block is discarded; the next block starts after text
      text, steps, draft, draft_steps = text + draft, steps + draft_steps, [], []
      if text and (text[-1] == s.eos_id or len(text) >= limit):
        return text, steps, nfe, rollbacks
      block[0], block_steps[0], first_pass = ntp[-1], nfe, False
      if block[0] == s.eos_id or len(text) + 1 >= limit:
        return text + block[:1], steps + block_steps[:1], nfe, rollbacks
    valid = [len(text) + j < limit for j in range(p)]
    open_ = [block[j] == MASK and valid[j] for j in range(p)]
    if any(open_):
      logp = masked_logp(logits[:, n:] / (s.temperature or 1.0))
      reveal = np.asarray(rule(logp, jnp.asarray([open_]), s.gamma))[0]
      if s.draft == "all":
        reveal = np.asarray(open_)
      sampled = _choose(logits[:, n:], s, (key, range(len(text), len(text) + p)))
      if s.settle_eos:
        reveal = settle_eos_reference(reveal, open_, sampled, s.eos_id)
      for j in np.flatnonzero(reveal):
        block[j], block_steps[j] = sampled[j], nfe
    eos = [j for j in range(p) if valid[j] and block[j] == s.eos_id]
    if eos:  # positions after the first EOS are closed and hold EOS
      block[eos[0] + 1 :] = [s.eos_id] * (p - eos[0] - 1)
    end = eos[0] + 1 if eos else sum(valid)
    if all(block[j] != MASK for j in range(end)):  # complete: the draft the next forward checks
      draft, draft_steps = block[:end], block_steps[:end]
      block, block_steps, first_pass = [MASK] * p, [0] * p, True
