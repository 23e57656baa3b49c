"""Hugging Face interop, offline: tiny random Llama-3 / Qwen-3 models built from configs.

Parity (fp32 logits, greedy tokens vs `generate`), import -> export round trip, sharded import,
fine-tune -> export, tokenizer special ids and one-line errors.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF parity tests need torch (pip install .[test])")
transformers = pytest.importorskip("transformers", reason="HF parity tests need transformers")
tokenizers = pytest.importorskip("tokenizers", reason="HF tests need tokenizers")
pytest.importorskip("safetensors", reason="HF tests need safetensors")

from flax import nnx  # noqa: E402
from hf_models import (  # noqa: E402  (tests/ is on sys.path)
  MAKERS,
  MODEL_VOCAB,
  make_llama,
)
from xla_env import subprocess_env  # noqa: E402  (tests/ is on sys.path)

from sbd_jax import sharding  # noqa: E402
from sbd_jax.attention.meta import TokenMeta  # noqa: E402
from sbd_jax.data.tokenizer import HFTokenizer, TokenizerError  # noqa: E402
from sbd_jax.decode import sampler  # noqa: E402
from sbd_jax.decode.settings import settings_for  # noqa: E402
from sbd_jax.hf import config_map, exporter, importer  # noqa: E402
from sbd_jax.run import loading  # noqa: E402
from sbd_jax.run import workdir as workdir_lib  # noqa: E402


@pytest.fixture(scope="module", params=sorted(MAKERS))
def converted(request, tmp_path_factory):
  """(name, HF torch model, HF dir, converted workdir)."""
  hf_dir = tmp_path_factory.mktemp(f"{request.param}_hf")
  model = MAKERS[request.param](str(hf_dir))
  out = tmp_path_factory.mktemp(f"{request.param}_converted")
  importer.import_hf(str(hf_dir), str(out), dtype="float32")
  return request.param, model, str(hf_dir), str(out)


def load_config_module(name):
  path = os.path.join(os.path.dirname(__file__), "..", "configs", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_cli(*args, check=True):
  """python -m sbd_jax.convert on one host device (the CLI's default mesh uses them all)."""
  env = subprocess_env(1)
  result = subprocess.run(
    [sys.executable, "-m", "sbd_jax.convert", *args],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  if check and result.returncode:
    raise AssertionError(f"convert {args} failed:\n{result.stderr[-3000:]}")
  return result


def random_tokens(batch, length, seed=0, high=256):
  return np.random.RandomState(seed).randint(0, high, (batch, length)).astype(np.int32)


def causal_meta(tokens):
  b, t = tokens.shape
  return TokenMeta.causal(
    jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  )


def our_logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens), causal_meta(tokens))[0])


def load_ours(workdir, attention_impl="chunked"):
  sm, config, tokenizer, mask_id = loading.load_sampling_model(
    workdir, attention_impl=attention_impl
  )
  return nnx.merge(sm.graphdef, sm.state), sm, tokenizer, mask_id


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


# Parity ------------------------------------------------------------------------------------


def test_converted_config(converted):
  name, _, _, out = converted
  c = workdir_lib.read_config(out)
  assert c.model.qk_norm == (name == "qwen3") and c.model.tie_embeddings == (name == "qwen3")
  if name == "llama":
    assert (c.model.rope_scaling_factor, c.model.rope_original_max_position) == (8.0, 32)
    assert c.sbd.mask_id == 258  # <|reserved_special_token_0|>
  else:
    assert (c.model.head_dim, c.model.rope_scaling_factor) == (24, 0.0)
    assert c.sbd.mask_id == 259  # first id past the tokenizer: an unused embedding row
  assert c.train.init_from == os.path.join(out, "params")
  assert os.path.isfile(c.tokenizer) and os.path.dirname(c.tokenizer) == out


def test_logits_match_transformers(converted):
  """fp32 logits over 96 positions: 3x the original RoPE context of the scaled Llama."""
  _, hf_model, _, out = converted
  ours, _, _, _ = load_ours(out)
  tokens = random_tokens(2, 96)
  np.testing.assert_allclose(
    our_logits(ours, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=0
  )


def greedy_decodes(workdir, hf_model, max_new_tokens):
  """(our KV-cached NTP decode, transformers generate(do_sample=False)) of two random prompts,
  as lists of generated token ids."""
  _, sm, tokenizer, mask_id = load_ours(workdir, attention_impl="dense")
  prompts = random_tokens(2, 40, seed=3)
  settings = settings_for(tokenizer, mask_id, mode="ntp", max_new_tokens=max_new_tokens)
  ours = sampler.decode(sm, prompts.tolist(), settings).tokens
  with torch.no_grad():
    ref = hf_model.generate(
      torch.tensor(prompts, dtype=torch.long),
      do_sample=False,
      max_new_tokens=max_new_tokens,
      min_new_tokens=0,
      eos_token_id=tokenizer.eos_id,
      pad_token_id=tokenizer.pad_id,
      suppress_tokens=[mask_id],
    )
  return [list(row) for row in ours], ref[:, prompts.shape[1] :].numpy().tolist()


def test_greedy_ntp_decode_matches_generate(converted):
  """The project's KV-cached NTP sampler == transformers generate(do_sample=False), 32 tokens."""
  _, hf_model, _, out = converted
  ours, ref = greedy_decodes(out, hf_model, 32)
  for ours_row, ref_row in zip(ours, ref):
    assert len(ours_row) == 32, "pick a seed whose decode does not hit EOS"
    assert ours_row == ref_row


def test_round_trip_through_transformers(converted, tmp_path):
  """import -> export -> from_pretrained: identical logits, mask id recorded, tokenizer loads."""
  _, hf_model, _, out = converted
  exporter.export_hf(out, str(tmp_path))
  reloaded = type(hf_model).from_pretrained(str(tmp_path)).eval()
  tokens = random_tokens(2, 48, seed=5)
  np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens))
  mask_id = workdir_lib.read_config(out).sbd.mask_id
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["sbd_mask_token_id"] == mask_id
  with open(tmp_path / "generation_config.json") as f:
    assert json.load(f)["sbd_mask_token_id"] == mask_id
  generation = transformers.GenerationConfig.from_pretrained(str(tmp_path))
  assert mask_id in generation.suppress_tokens  # plain generate never emits the mask
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf_tok("hi there", add_special_tokens=False)["input_ids"] == (
    HFTokenizer.from_path(str(tmp_path)).encode("hi there")
  )


def test_scanned_import_decodes_like_generate_and_exports_bit_exact(llama_dirs, tmp_path):
  """A converted model with stacked layers: KV-cached greedy decode == generate, and the
  export (layers unstacked again) reloads in transformers with identical weights."""
  hf_model, hf_dir = llama_dirs
  out, hf_out = tmp_path / "converted", tmp_path / "exported"
  c = importer.import_hf(hf_dir, str(out), dtype="float32", scan_layers=True)
  assert c.model.scan_layers
  ours, ref = greedy_decodes(str(out), hf_model, 16)
  assert ours == ref
  exporter.export_hf(str(out), str(hf_out))
  reloaded = transformers.LlamaForCausalLM.from_pretrained(str(hf_out))
  original, again = hf_model.state_dict(), reloaded.state_dict()
  assert original.keys() == again.keys()
  assert all(torch.equal(original[k], again[k]) for k in original)


# Sharding and large-checkpoint paths ---------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
  hf_dir = tmp_path_factory.mktemp("llama_hf_shard")
  model = make_llama(str(hf_dir))
  return model, str(hf_dir)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_sharded_import_on_2x2x2_mesh(llama_dirs, scan_layers):
  hf_model, hf_dir = llama_dirs
  cfg = config_map.model_config_from_hf(
    importer.read_hf_config(hf_dir), param_dtype="float32", scan_layers=scan_layers
  )
  mesh = sharding.make_mesh((2, 2, 2))
  params = importer.load_hf_params(hf_dir, cfg, mesh)
  if scan_layers:  # layers stacked on an unsharded leading axis
    q = params["blocks"]["attention"]["q_DNH"][...]
    assert q.shape[0] == cfg.num_layers
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  else:
    q = params["blocks"][0]["attention"]["q_DNH"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert all(s.data.size == q.size // 4 for s in q.addressable_shards)  # not replicated
  model = importer.Transformer(cfg, rngs=nnx.Rngs(0))
  nnx.update(model, params)
  tokens = random_tokens(2, 64, seed=7)
  with sharding.activation_sharding(mesh):
    logits = np.asarray(jax.jit(lambda m, t: m(t, causal_meta(t))[0])(model, jnp.asarray(tokens)))
  np.testing.assert_allclose(logits, hf_logits(hf_model, tokens), atol=1e-4, rtol=0)


def test_sharded_safetensors_with_index(llama_dirs, tmp_path):
  """Export in several shards with an index, then import that: the same tensors."""
  hf_model, hf_dir = llama_dirs
  cfg = config_map.model_config_from_hf(importer.read_hf_config(hf_dir), param_dtype="float32")
  params = importer.load_hf_params(hf_dir, cfg)
  files = exporter.save_hf_weights(params, cfg, str(tmp_path), max_shard_bytes=40_000)
  assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").exists()
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
  again = importer.load_hf_params(str(tmp_path), cfg)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(params), nnx.to_pure_dict(again))


def test_bfloat16_checkpoint_round_trip_is_bit_exact(tmp_path):
  """Real checkpoints are bf16: import keeps the checkpoint dtype, export writes the same bits."""
  hf_dir, out, hf_out = tmp_path / "hf", tmp_path / "converted", tmp_path / "exported"
  hf_dir.mkdir()
  model = make_llama(str(hf_dir)).to(torch.bfloat16)
  model.save_pretrained(str(hf_dir))
  c = importer.import_hf(str(hf_dir), str(out))
  assert (c.model.param_dtype, c.model.compute_dtype) == ("bfloat16", "bfloat16")
  exporter.export_hf(str(out), str(hf_out))
  reloaded = transformers.LlamaForCausalLM.from_pretrained(str(hf_out), dtype=torch.bfloat16)
  original, again = model.state_dict(), reloaded.state_dict()
  assert original.keys() == again.keys()
  assert all(
    again[k].dtype == torch.bfloat16 and torch.equal(original[k], again[k]) for k in original
  )


# Fine-tune a converted model, then export --------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("scan_layers", [False, True])
def test_finetune_converted_model_then_export(llama_dirs, tmp_path, scan_layers):
  """Convert with the CLI, fine-tune with SBD via configs/tiny_hf.py, export, load in HF.

  With scan_layers the run stacks the converted (unrolled) params on load, trains the stacked
  layout, and the export unstacks it again.
  """
  hf_model, hf_dir = llama_dirs
  out = str(tmp_path / "converted")
  run_cli("hf-to-orbax", f"--hf_dir={hf_dir}", f"--out={out}", "--dtype=float32")
  tiny_hf = load_config_module("tiny_hf")
  from sbd_jax.training import trainer

  data = tmp_path / "train.jsonl"
  with open(data, "w") as f:
    for i in range(64):
      f.write(json.dumps({"prompt": f"Q: {i}+{i}=", "completion": f" {2 * i}."}) + "\n")
  c = tiny_hf.get_config(out)
  assert c.train.init_from == os.path.join(out, "params") and c.tokenizer.startswith(out)
  c.data.paths = str(data)
  c.model.scan_layers = scan_layers
  c.train.steps, c.train.batch_size, c.train.seq_len, c.train.log_every = 3, 8, 32, 1
  c.checkpoint.every_steps, c.checkpoint.async_save = 2, False
  c.train.progress_bar, c.optim.warmup_steps, c.optim.lr = False, 1, 1e-3
  run = tmp_path / "run"
  metrics = trainer.train(c, str(run))
  assert np.isfinite(metrics["loss"]) and metrics["matp_loss"] >= 0
  hf_out = tmp_path / "hf"
  exporter.export_hf(str(run), str(hf_out))
  tuned = transformers.LlamaForCausalLM.from_pretrained(str(hf_out)).eval()
  tokens = random_tokens(1, 40, seed=9)
  ours, _, _, _ = load_ours(str(run))
  tuned_logits = hf_logits(tuned, tokens)
  np.testing.assert_allclose(our_logits(ours, tokens), tuned_logits, atol=1e-4, rtol=0)
  assert np.abs(tuned_logits - hf_logits(hf_model, tokens)).max() > 1e-3  # it did train
  with open(hf_out / "config.json") as f:
    exported = json.load(f)
  assert exported["sbd_mask_token_id"] == 258 and exported["rope_scaling"]["factor"] == 8.0


# Tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_special_ids_and_round_trip(converted):
  name, _, hf_dir, _ = converted
  tok = HFTokenizer.from_path(hf_dir)
  text = "naïve café: 12+7=19 ✓"
  ids = tok.encode(text)
  assert all(i < 256 for i in ids)  # no specials added
  assert tok.decode([tok.bos_id, *ids, tok.mask_id, tok.eos_id, tok.pad_id]) == text
  if name == "llama":
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (256, 257, 260, 258)
  else:  # no BOS: <|endoftext|> stands in; mask is the first unused id
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (256, 258, 256, 259)
    assert tok.vocab_size == 260


def test_tokenizer_mask_choice(converted):
  _, _, hf_dir, _ = converted
  chosen = HFTokenizer.from_path(
    hf_dir, mask_token="<|im_start|>" if "qwen" in hf_dir else "<|reserved_special_token_1|>"
  )
  assert chosen.mask_id == 257 if "qwen" in hf_dir else chosen.mask_id == 259
  assert HFTokenizer.from_path(hf_dir, mask_id=270).mask_id == 270
  with pytest.raises(TokenizerError, match="not in the vocabulary"):
    HFTokenizer.from_path(hf_dir, mask_token="<nope>")
  with pytest.raises(TokenizerError, match="equals the eos id"):
    eos = "<|end_of_text|>" if "llama" in hf_dir else "<|im_end|>"
    HFTokenizer.from_path(hf_dir, mask_token=eos)
  with pytest.raises(TokenizerError, match="outside the vocabulary"):
    HFTokenizer.from_path(hf_dir, mask_id=MODEL_VOCAB, model_vocab_size=MODEL_VOCAB)


# Errors --------------------------------------------------------------------------------------


def _one_line_error(exc_info):
  message = str(exc_info.value)
  assert "\n" not in message
  return message


def test_errors_are_one_line(llama_dirs, tmp_path):
  _, hf_dir = llama_dirs
  with pytest.raises(config_map.HFConversionError) as e:
    importer.import_hf(str(tmp_path), str(tmp_path / "out"))
  assert "no config.json" in _one_line_error(e)

  no_weights = tmp_path / "no_weights"
  no_weights.mkdir()
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    (no_weights / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
  with pytest.raises(config_map.HFConversionError) as e:
    importer.import_hf(str(no_weights), str(tmp_path / "out"))
  assert "no model.safetensors" in _one_line_error(e)

  hf = importer.read_hf_config(hf_dir)
  with pytest.raises(config_map.HFConversionError) as e:
    config_map.model_config_from_hf({**hf, "architectures": ["GPT2LMHeadModel"]})
  assert "unsupported architecture" in _one_line_error(e)
  with pytest.raises(config_map.HFConversionError) as e:
    config_map.model_config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
  assert "rope_type" in _one_line_error(e)

  with pytest.raises(TokenizerError) as e:
    importer.import_hf(hf_dir, str(tmp_path / "out"), mask_token="<|begin_of_text|>")
  assert "bos" in _one_line_error(e)


@pytest.mark.integration
def test_cli_reports_usage_error(tmp_path):
  """The CLI turns conversion errors into one-line usage errors (no traceback)."""
  result = run_cli("hf-to-orbax", f"--hf_dir={tmp_path}", f"--out={tmp_path / 'out'}", check=False)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr and "no config.json" in result.stderr


PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]


@pytest.mark.integration
def test_text_prompts_decode_like_generate_on_the_hf_tokenization(converted):
  """Prompts are tokenized as transformers' tokenizer(prompt) does (Llama: its post-processor's
  BOS; Qwen-3: no BOS at all), and NTP decoding then equals generate on those ids, through the
  library and through `python -m sbd_jax.sample`."""
  name, hf_model, hf_dir, out = converted
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  _, sm, tokenizer, mask_id = load_ours(out, attention_impl="dense")
  settings = settings_for(tokenizer, mask_id, mode="ntp", max_new_tokens=12)
  ours = sampler.decode_text(sm, tokenizer, PROMPTS, settings)
  prompts_file = os.path.join(out, "prompts.txt")
  with open(prompts_file, "w") as f:
    f.write("\n".join(p.replace("\n", "\\n") for p in PROMPTS) + "\n")
  sampled = subprocess.run(
    [sys.executable, "-m", "sbd_jax.sample", f"--workdir={out}", f"--prompts_file={prompts_file}"]
    + ["--max_new_tokens=12", "--json"],
    capture_output=True,
    text=True,
    env=subprocess_env(1),
  )
  assert sampled.returncode == 0, sampled.stderr[-2000:]
  printed = json.loads(sampled.stdout)
  for i, prompt in enumerate(PROMPTS):
    ids = hf_tok(prompt)["input_ids"]
    assert tokenizer.encode_document(prompt) == ids
    assert (ids[0] == hf_tok.bos_token_id) == (name == "llama")
    with torch.no_grad():
      ref = hf_model.generate(
        torch.tensor([ids]),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        suppress_tokens=[mask_id],
      )[0, len(ids) :].tolist()
    assert ours.tokens[i] == ref
    expected = hf_tok.decode([t for t in ref if t != tokenizer.eos_id], skip_special_tokens=True)
    assert printed[i]["prompt"] == prompt and printed[i]["ntp"] == expected
