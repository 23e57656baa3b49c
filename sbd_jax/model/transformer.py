"""Decoder-only transformer (Llama-3.x / Qwen-3 family) in Flax NNX.

One forward serves training and decoding: tokens come with `TokenMeta`, and attention masks
are derived from it (see `sbd_jax.attention`). With a `KVCache`, the new tokens' keys and
values are written at slots [cache.end, cache.end + T) and attention runs over the whole cache;
the caller decides how many of those slots to commit by advancing `cache.end` (one slot for the
batch, or one per row when rows commit at different rates).

The cache layout is in `sbd_jax.model.kv_cache`.

Dimension letters (docs/dimensions.md): B batch, T new tokens, S cache slots, D width, N query
heads, K KV heads, H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from sbd_jax import sharding
from sbd_jax.attention.dispatch import attend
from sbd_jax.attention.meta import TokenMeta
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.model.kv_cache import KVCache, LayerCache, write_slots
from sbd_jax.model.layers import (
  MLP,
  Embedding,
  RMSNorm,
  apply_rope,
  param,
  rope_inverse_frequencies,
)


class Attention(nnx.Module):
  """Grouped-query attention with RoPE and optional per-head QK RMSNorm."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(0.02)
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.q_DNH = param(rngs, init, (d, n, h), dtype, ("embed", "q_heads", "head_dim"))
    self.k_DKH = param(rngs, init, (d, k, h), dtype, ("embed", "kv_heads", "head_dim"))
    self.v_DKH = param(rngs, init, (d, k, h), dtype, ("embed", "kv_heads", "head_dim"))
    self.o_NHD = param(rngs, init, (n, h, d), dtype, ("q_heads", "head_dim", "embed"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, dtype, rngs=rngs)
      self.k_norm = RMSNorm(h, cfg.norm_eps, dtype, rngs=rngs)
    self.inv_freq = nnx.Cache(rope_inverse_frequencies(h, cfg.rope_theta, cfg.rope_scaling))

  def __call__(self, x_BTD: jax.Array, meta: TokenMeta, layer_cache: LayerCache | None = None):
    """Returns the attention output and, with a cache, the updated (k, v) buffers."""
    cfg = self.cfg
    cast = lambda p: p[...].astype(cfg.compute_dtype)  # noqa: E731
    q_BTNH = checkpoint_name(jnp.einsum("BTD,DNH->BTNH", x_BTD, cast(self.q_DNH)), "query_proj")
    k_BTKH = checkpoint_name(jnp.einsum("BTD,DKH->BTKH", x_BTD, cast(self.k_DKH)), "key_proj")
    v_BTKH = checkpoint_name(jnp.einsum("BTD,DKH->BTKH", x_BTD, cast(self.v_DKH)), "value_proj")
    if cfg.qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    inv_freq = self.inv_freq[...]
    q_BTNH = apply_rope(q_BTNH, meta.positions, inv_freq)
    k_BTKH = apply_rope(k_BTKH, meta.positions, inv_freq)
    q_BTNH = sharding.constrain(q_BTNH, ("act_batch", "act_length", "act_heads", None))

    if layer_cache is None:
      k_all, v_all, kv_meta, new_layer_cache = k_BTKH, v_BTKH, meta, None
    else:
      kv_meta, start = layer_cache.meta, layer_cache.start
      if layer_cache.heads_first:  # [B, K, S, H]: written as such, read through a transpose
        swap = lambda x: x.swapaxes(1, 2)  # noqa: E731
        new_layer_cache = (
          write_slots(layer_cache.k, swap(k_BTKH), start, axis=2),
          write_slots(layer_cache.v, swap(v_BTKH), start, axis=2),
        )
        k_all, v_all = map(swap, new_layer_cache)
      else:
        k_all, v_all = (
          write_slots(layer_cache.k, k_BTKH, start),
          write_slots(layer_cache.v, v_BTKH, start),
        )
        new_layer_cache = (k_all, v_all)
    impl = cfg.attention_impl
    if impl == "splash" and layer_cache is not None:  # splash needs whole tiles of queries
      impl = "chunked"
    if impl == "dense" and layer_cache is not None and q_BTNH.shape[1] > cfg.attention_chunk:
      # A prompt's prefill: dense scores over the cache would be [B, N, T, S] floats (20 rows of
      # an 8k prompt on the main job's model: 45 GB); the chunked kernel holds a chunk of keys.
      impl = "chunked"
    o_BTNH = attend(q_BTNH, k_all, v_all, meta, kv_meta, impl=impl, chunk=cfg.attention_chunk)
    # One contraction over F = N * H, with both reshapes free (row-major): as "BTNH,NHD->BTD",
    # XLA:CPU copies o_NHD into another layout at every forward.
    b, t, n, h = o_BTNH.shape
    o_FD = cast(self.o_NHD).reshape(n * h, -1)
    out_BTD = jnp.einsum("BTF,FD->BTD", o_BTNH.reshape(b, t, n * h), o_FD)
    return checkpoint_name(out_BTD, "out_proj"), new_layer_cache


class Block(nnx.Module):
  """Pre-norm residual block: attention then SwiGLU MLP."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    self.attention_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, dtype, rngs=rngs)
    self.attention = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, dtype, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_BTD, meta: TokenMeta, layer_cache=None):
    x_BTD = checkpoint_name(x_BTD, "decoder_layer_input")
    attn_BTD, new_layer_cache = self.attention(self.attention_norm(x_BTD), meta, layer_cache)
    x_BTD = x_BTD + attn_BTD
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    return sharding.constrain(x_BTD, ("act_batch", "act_length", "act_embed")), new_layer_cache


# What a rematerialised layer keeps for the backward pass ("full": only its input). "offload":
# the layer's input and its q, k, v and output projections are moved to host memory and back
# for the backward pass instead of being recomputed or held in HBM (TPU; the policy MaxText's
# Llama-3.1 8B runs use).
OFFLOADED_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")
REMAT_POLICIES = {
  "full": None,
  "dots": jax.checkpoint_policies.dots_saveable,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=list(OFFLOADED_NAMES),
    offload_src="device",
    offload_dst="pinned_host",
  ),
}


def _run_block(block: Block, x_BTD, meta: TokenMeta):
  return block(x_BTD, meta)[0]


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """One Block whose parameters carry a leading [num_layers] axis (logical name "layers")."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs=rngs)

  return make(rngs)


class Transformer(nnx.Module):
  """Token ids + metadata -> logits [B, T, V] (and an updated KV cache when given one)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embedding(cfg, rngs=rngs)
    if cfg.scan_layers:  # one compiled layer body, run by lax.scan
      self.blocks = _stacked_blocks(cfg, rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, jnp.dtype(cfg.param_dtype), rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head_DV = param(
        rngs,
        jax.nn.initializers.normal(0.02),
        (cfg.embed_dim, cfg.vocab_size),
        jnp.dtype(cfg.param_dtype),
        ("embed", "vocab"),
      )

  def __call__(
    self, tokens_BT: jax.Array, meta: TokenMeta, cache: KVCache | None = None
  ) -> tuple[jax.Array, KVCache | None]:
    x_BTD, new_cache = self.features(tokens_BT, meta, cache)
    return self.logits(x_BTD), new_cache

  def features(
    self, tokens_BT: jax.Array, meta: TokenMeta, cache: KVCache | None = None
  ) -> tuple[jax.Array, KVCache | None]:
    """The final-normed hidden states [B, T, D] that `logits` maps to the vocabulary."""
    x_BTD = sharding.constrain(self.embed(tokens_BT), ("act_batch", "act_length", "act_embed"))
    if cache is None:
      x_BTD = self._run_layers(x_BTD, meta)
      new_cache = None
    else:
      kv_meta = jax.tree.map(lambda c, m: write_slots(c, m, cache.end), cache.meta, meta)
      ks, vs = [], []
      for block, k, v in zip(self._layers(), cache.k, cache.v):
        layer_cache = LayerCache(k, v, kv_meta, cache.end, cache.heads_first)
        x_BTD, (k, v) = block(x_BTD, meta, layer_cache)
        ks.append(k)
        vs.append(v)
      new_cache = cache.replace(k=tuple(ks), v=tuple(vs), meta=kv_meta)
    return self.final_norm(x_BTD), new_cache

  def _run_layers(self, x_BTD: jax.Array, meta: TokenMeta) -> jax.Array:
    """Every layer without a cache (training, scoring), unrolled or scanned, with remat."""
    remat = self.cfg.remat != "none"
    policy = REMAT_POLICIES.get(self.cfg.remat)
    if not self.cfg.scan_layers:
      run = nnx.remat(_run_block, policy=policy) if remat else _run_block
      for block in self.blocks:
        x_BTD = run(block, x_BTD, meta)
      return x_BTD

    graphdef, stacked = nnx.split(self.blocks)

    def body(x_BTD, layer_state):
      # Tie the (loop-invariant) metadata to the carry: otherwise XLA hoists the attention
      # masks of every chunk pair out of the loop, [T, T]-sized: the 8B recipe's step would
      # no longer fit a TPU chip (tests/test_scan.py checks the growth on the CPU compiler).
      x_BTD, layer_meta = jax.lax.optimization_barrier((x_BTD, meta))
      return nnx.merge(graphdef, layer_state)(x_BTD, layer_meta)[0], None

    if remat:  # prevent_cse=False: scan already keeps the recomputation where it belongs
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x_BTD, stacked)[0]

  def _layers(self) -> list[Block]:
    """The layers as separate Blocks (slices of the stacked parameters when scanned).

    Decoding runs them unrolled: each forward writes every layer's KV cache in place, which a
    scan would return as fresh stacked buffers.
    """
    if not self.cfg.scan_layers:
      return list(self.blocks)
    graphdef, stacked = nnx.split(self.blocks)
    return [
      nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], stacked))
      for i in range(self.cfg.num_layers)
    ]

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    if self.cfg.tie_embeddings:
      logits_BTV = self.embed.attend(x_BTD)
    else:
      logits_BTV = jnp.einsum(
        "BTD,DV->BTV", x_BTD, self.lm_head_DV[...].astype(self.cfg.compute_dtype)
      )
    return sharding.constrain(logits_BTV, ("act_batch", "act_length", "act_vocab"))


def count_params(model_or_state) -> int:
  state = nnx.state(model_or_state, nnx.Param)
  return sum(x.size for x in jax.tree.leaves(state))
