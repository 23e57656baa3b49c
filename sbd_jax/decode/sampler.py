"""Sampling from a trained model on the host side: prompts in, tokens and texts out.

`decode` batches prompts, left-pads each batch to a power-of-two length bucket (so compilations
repeat), places weights for sampling and calls the compiled on-device loop
(`compiled.decode_batch`; with refill, `queue.decode_queue`). The forwards are described in
`loop`, the NFE accounting in `reveal`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sbd_jax import sharding
from sbd_jax.constrain.spec import Constraint
from sbd_jax.decode import acceptance_prior, automata, costs, memory, output, policy
from sbd_jax.decode.compiled import BatchResult, StaticGraph, decode_batch, unpack
from sbd_jax.decode.output import DecodeOutput
from sbd_jax.decode.queue import decode_queue
from sbd_jax.decode.settings import TRACED_CONSTRAINT, SamplerSettings
from sbd_jax.decode.state import default_tuning
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SamplingModel:
  """A model split for sampling: weights enter the jitted decode as an argument. `priors`: what
  its verified rows have accepted so far, per way of drafting (`prior_for`), which each
  decode's rows start from."""

  graphdef: Any
  state: nnx.State
  cfg: ModelConfig
  priors: dict[tuple, acceptance_prior.Prior] = dataclasses.field(default_factory=dict)

  def prior_for(self, s: SamplerSettings) -> acceptance_prior.Prior:
    """The prior of decodes that draft as `s` does (block, drafts, rule, greedy or sampled)."""
    key = (s.block_size, s.draft, s.rule, s.check_every_forward, s.temperature > 0)
    return self.priors.setdefault(key, acceptance_prior.Prior())

  @classmethod
  def of(cls, model: Transformer) -> "SamplingModel":
    graphdef, state = nnx.split(model)
    return cls(graphdef=graphdef, state=state, cfg=model.cfg)

  @functools.cached_property
  def static_graph(self) -> StaticGraph:
    """The structure as the decode's static argument, hashed once per SamplingModel."""
    return StaticGraph.of(self.graphdef, self.state)

  @functools.cached_property
  def weights(self) -> list[jax.Array]:
    """The state's leaves, as the decode takes them (`static_graph` rebuilds the state)."""
    return jax.tree.leaves(self.state)

  def sharded(self, mesh: Mesh) -> "SamplingModel":
    """The same weights placed with SAMPLING_RULES (tensor parallel, replicated over data/fsdp)."""
    shardings = sharding.state_shardings(self.state, mesh, sharding.SAMPLING_RULES)
    return dataclasses.replace(self, state=jax.device_put(self.state, shardings))


def prompt_bucket(length: int, min_bucket: int = 16) -> int:
  """Prompt slots L for a prompt of `length` tokens: the next power of two, at least min_bucket."""
  return max(min_bucket, 1 << max(0, length - 1).bit_length())


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
  if not prompts:
    raise ValueError("no prompts to decode")
  for i, prompt in enumerate(prompts):
    if len(prompt) == 0:
      raise ValueError(f"prompt {i} is empty: a prompt needs at least one token (e.g. BOS)")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
      raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")


def _check_request(cfg, prompts, s: SamplerSettings, rows, ways, cache_length, min_bucket):
  """One-line ValueErrors, before anything is allocated, for requests that cannot run."""
  _check_prompts(prompts, cfg.vocab_size)
  for name in ("eos_id", "mask_id", "pad_id"):
    if not 0 <= getattr(s, name) < cfg.vocab_size and (name, getattr(s, name)) != ("eos_id", -1):
      raise ValueError(f"{name} {getattr(s, name)} is outside the vocabulary [0, {cfg.vocab_size})")
  longest = max(len(p) for p in prompts)
  needed = s.cache_slots(prompt_bucket(longest, min_bucket), rows)
  if cache_length is not None and needed > cache_length:
    raise ValueError(
      f"prompt of {longest} tokens (bucket {prompt_bucket(longest, min_bucket)}) "
      f"+ {needed - prompt_bucket(longest, min_bucket)} response slots needs {needed} cache "
      f"slots, more than cache_length={cache_length}"
    )
  bucket = prompt_bucket(longest, min_bucket)
  memory.check_fits_in_memory(cfg, rows, needed, ways, prefill_tokens=bucket + s.block_size)


def decode(
  model: SamplingModel | Transformer,
  prompts: Sequence[Sequence[int]],
  settings: SamplerSettings,
  *,
  seed: int = 0,
  batch_size: int | None = None,
  mesh: Mesh | None = None,
  cache_length: int | None = None,
  min_bucket: int = 16,
  tokenizer=None,
  constraints: Sequence[Constraint | None] | None = None,
) -> DecodeOutput:
  """Decode token-id prompts (each already starting with BOS if the model expects one).

  Prompts are processed in input order, `batch_size` at a time (default: all); each batch is
  left-padded to `prompt_bucket` of its longest prompt, and a short last batch is padded with
  inactive rows, so compilations repeat per (bucket, batch size, settings). With
  `settings.refill`, all prompts instead queue for `batch_size` rows in one call, a finished
  row taking the next prompt (`queue.decode_queue`). With `mesh`, the rows are split over (data,
  fsdp) and weights follow SAMPLING_RULES. `cache_length`, if given, is the KV cache's length:
  a request that needs more (prompt bucket + response slots) is refused; a longer cache only
  adds slots that nothing sees (benchmarks use it to time decodes of different lengths over
  one cache). With refill it is only that limit. A constraint (`settings.constraint`, or one
  per prompt in `constraints`, None for none: rows with different constraints share a batch)
  compiles over `tokenizer`'s vocabulary (`decode.automata`), which it then needs.
  """
  sm = model if isinstance(model, SamplingModel) else SamplingModel.of(model)
  if constraints is not None:
    if len(constraints) != len(prompts):
      raise ValueError(f"{len(constraints)} constraints for {len(prompts)} prompts")
    if settings.constrained:
      raise ValueError("give the constraint in the settings or one per prompt, not both")
    settings = settings.replace(constraint=TRACED_CONSTRAINT)  # one constrained program
  s = settings
  batch_size = batch_size or len(prompts)
  ways = sharding.row_shards(mesh)
  rows = -(-batch_size // ways) * ways
  _check_request(sm.cfg, prompts, s, rows, ways, cache_length, min_bucket)
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed {seed} is outside [0, 2**32)")
  if mesh is not None:
    sm = sm.sharded(mesh)
  automaton = _row_automata(sm, s, tokenizer, constraints or [s.constraint] * len(prompts))
  if s.refill:
    return _decode_queued(sm, prompts, s, seed, rows, min_bucket, mesh, automaton)
  out = output.empty(len(prompts), s)
  for first in range(0, len(prompts), batch_size):
    chunk = list(prompts[first : first + batch_size])
    l = prompt_bucket(max(len(p) for p in chunk), min_bucket)
    prompt_BQ = np.full((rows, l), s.pad_id, np.int32)
    prompt_len_B = np.ones((rows,), np.int32)
    active_B = np.zeros((rows,), bool)
    for i, prompt in enumerate(chunk):
      prompt_BQ[i, l - len(prompt) :] = prompt
      prompt_len_B[i], active_B[i] = len(prompt), True
    args = (prompt_BQ, prompt_len_B, active_B)
    if mesh is not None:
      args = tuple(jax.device_put(a, sharding.batch_sharding(mesh, a.ndim)) for a in args)

    def program(s: SamplerSettings):
      call = functools.partial(
        decode_batch,
        sm.static_graph,
        sm.weights,
        *args,
        np.uint32(seed),
        np.int32(first),
        np.float32(s.gamma),
        np.float32(s.temperature),
        settings=s.with_traced_values(),  # one compilation serves every γ and temperature
        model_cfg=sm.cfg,
        cache_length=cache_length or s.cache_slots(l, rows),
        mesh=mesh,
      )
      if automaton is not None:  # each row starts at its constraint's initial state
        first_B = np.zeros((rows,), np.int32)
        first_B[: len(chunk)] = automaton.first_state_B[first : first + len(chunk)]
        call = functools.partial(call, ctables=automaton.ctables, cstate_B=first_B)
      key = ("decode_batch", sm.cfg, s.with_traced_values(), rows, l, call.keywords["cache_length"])
      return call, key

    call, key = program(s)
    tuning, out.cost_table = _tuning(sm, s, rows, key, call, mesh, out.cost_table)
    got = _run(sm, s, rows, program, call, tuning, mesh, out)
    output.record(out, got, first, len(chunk), s)
    _learn(sm, s, got, len(chunk))
  return out


def _run(sm: SamplingModel, s: SamplerSettings, rows, program, call, tuning, mesh, out):
  """One call's `BatchResult`: `call(tuning, limit)`, the program of `s`, or where the model's
  drafts do not pay (`acceptance_prior.Prior.verifies_next`) NTP's own, `program(NTP's
  settings)[0]`, which decodes the same text (counted in `out.ntp_calls`)."""
  if not _verifies(sm, s, tuning):
    prior = sm.prior_for(s)
    if prior.ntp_calls == 1:  # the first since a verified call
      log.info(
        "drafts accepted at %.2f do not pay at these costs: the next %d calls run NTP's program",
        prior.value,
        prior.call_gap,
      )
    ntp = s.replace(mode="ntp")
    ntp_call, _ = program(ntp)
    packed = np.asarray(ntp_call(default_tuning(ntp), np.int32(s.max_new_tokens)))
    out.ntp_calls += 1
    return _as_verified(unpack(packed, ntp.response_slots, ntp.block_size), s)
  packed = np.asarray(call(tuning, np.int32(s.max_new_tokens)))
  return unpack(packed, s.response_slots, s.block_size)


def _verifies(sm: SamplingModel, s: SamplerSettings, tuning: policy.Tuning) -> bool:
  """Whether a call of `s` runs its own program (`acceptance_prior.Prior.verifies_next`):
  always, unless `s` chooses its forwards unforced and unconstrained (a constrained verified
  decode settles forced tokens without the model, which NTP's program does not)."""
  if not s.chooses_forwards or s.constrained or int(tuning.force) >= 0:
    return True
  return sm.prior_for(s).verifies_next(np.asarray(tuning.cost_K), s.draft_widths)


def _as_verified(got: BatchResult, s: SamplerSettings) -> BatchResult:
  """NTP's program's result counted as a verified decode counts it: every forward after the
  prefill one of NTP's one-token forwards (kind 0 of `s`'s kinds)."""
  kinds_K = np.zeros(1 + len(s.draft_widths), got.kind_forwards.dtype)
  kinds_K[policy.NTP] = got.forwards - got.prefills
  return got._replace(
    row_ntp_forwards_B=np.maximum(got.row_forwards_B - 1, 0),  # each row's own prefill
    ntp_forwards=got.forwards - got.prefills,
    kind_forwards=kinds_K,
  )


def _row_automata(sm: SamplingModel, s: SamplerSettings, tokenizer, constraints):
  """A constrained decode's tables, with each prompt's initial state, else None."""
  if not s.constrained:
    return None
  if tokenizer is None:
    raise ValueError("a constrained decode needs the tokenizer its constraint compiles over")
  vocab = automata.vocabulary(tokenizer, s, sm.cfg.vocab_size)
  return automata.compile_rows(constraints, vocab, s.mask_id)


def _decode_queued(
  sm: SamplingModel, prompts, s: SamplerSettings, seed, rows, min_bucket, mesh, automaton=None
):
  """All prompts through `rows` rows, a finished row taking the next prompt (`queue.decode_queue`).
  Prompts share one length bucket, and their count is padded to a power of two (the count
  that is real is traced), so compilations repeat per (bucket, count bucket, rows). With a
  mesh the queue is one, replicated; the rows are split over (data, fsdp)."""
  l = prompt_bucket(max(len(p) for p in prompts), min_bucket)
  j = prompt_bucket(len(prompts), min_bucket=1)
  prompt_JQ = np.full((j, l), s.pad_id, np.int32)
  prompt_len_J = np.ones((j,), np.int32)
  for i, prompt in enumerate(prompts):
    prompt_JQ[i, l - len(prompt) :] = prompt
    prompt_len_J[i] = len(prompt)
  if mesh is not None:  # every process holds the whole queue (the same prompts)
    prompt_JQ, prompt_len_J = jax.device_put((prompt_JQ, prompt_len_J), sharding.replicated(mesh))

  def program(s: SamplerSettings):
    def call(tuning, limit, queued: int = len(prompts)):
      return decode_queue(
        sm.static_graph,
        sm.weights,
        prompt_JQ,
        prompt_len_J,
        np.int32(queued),
        np.uint32(seed),
        np.float32(s.gamma),
        np.float32(s.temperature),
        tuning,
        limit,
        None if automaton is None else automaton.ctables,
        None if automaton is None else np.pad(automaton.first_state_B, (0, j - len(prompts))),
        rows=rows,
        settings=s.with_traced_values(),  # one compilation serves every γ and temperature
        model_cfg=sm.cfg,
        cache_length=s.cache_slots(l, rows),
        mesh=mesh,
      )

    return call, ("decode_queue", sm.cfg, s.with_traced_values(), rows, j, l)

  call, key = program(s)
  # Timed with the first `rows` prompts only: one per row, no refill.
  timed = functools.partial(call, queued=min(rows, len(prompts)))
  tuning, table = _tuning(sm, s, rows, key, timed, mesh)
  out = output.empty(len(prompts), s)
  out.cost_table = table
  got = _run(sm, s, rows, program, call, tuning, mesh, out)
  output.record(out, got, 0, len(prompts), s)
  _learn(sm, s, got, len(prompts))
  return out


def _tuning(sm: SamplingModel, s: SamplerSettings, rows, key, call, mesh, table=None):
  """(the tuning of a decode program `call(tuning, limit)`, its cost table; `costs.tuning`) with
  the model's prior; `table`, the first program's, is returned in place of a later one's."""

  def run(kind: int, limit: int) -> tuple[float, int]:
    began = time.perf_counter()
    packed = np.asarray(call(costs.forced(s, kind), np.int32(limit)))
    return time.perf_counter() - began, int(packed[0, -4])  # `compiled.pack`: the forwards

  mesh_shape = None if mesh is None else tuple(mesh.shape.items())
  tuning, here = costs.tuning(s, rows, costs.program_key(*key, mesh_shape), run, sm.prior_for(s))
  return tuning, table or here


def _learn(sm: SamplingModel, s: SamplerSettings, got: BatchResult, count: int) -> None:
  """Add the verified rows' draft tokens tried and rejected, by block position, to the model's
  prior."""
  if s.verified:
    a = got.acceptance
    sm.prior_for(s).add(a.tried_in_block_BP[:count].sum(0), a.rejected_in_block_BP[:count].sum(0))


def decode_text(
  model: SamplingModel | Transformer,
  tokenizer,
  prompts: Sequence[str],
  settings: SamplerSettings,
  **kwargs,
) -> DecodeOutput:
  """Decode text prompts, each encoded as `tokenizer.encode_document` does (a converted HF
  tokenizer: exactly as transformers would; BOS where it adds one); texts exclude the EOS."""
  ids = []
  for i, prompt in enumerate(prompts):
    if not prompt:
      raise ValueError(f"prompt {i} is empty")
    ids.append(list(tokenizer.encode_document(prompt)))
  out = decode(model, ids, settings, tokenizer=tokenizer, **kwargs)
  out.texts = [tokenizer.decode([t for t in toks if t != settings.eos_id]) for toks in out.tokens]
  return out
